// How every kernel family with per-ISA implementations (gemm, attention, swiglu, cross_entropy,
// deltanet, peak) chooses one. Each family has a table of implementations, fastest first, each
// row a name, the ISA level it needs and its entry points. At first use the family takes, once:
//   - the row CPUTRAIN_<FAMILY> names (CPUTRAIN_SWIGLU=avx2), or force_kernel(family, name)
//     (the CLI's --kernel family=name);
//   - else the first row that is taken by default and whose level this CPU has, at or below the
//     ceiling CPUTRAIN_ISA sets (the CLI's --isa; avx2 runs every family's AVX2 build).
// kernel_choices() chooses every family's row now and names them, for the start-up log. Adding
// an ISA is a file with the implementation and one row in its family's table.
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace cputrain::kernels {

// Instruction-set levels, each including the ones below it. Avx2 (with FMA) is the build's
// baseline: every x86-64-v3 CPU has it.
enum class Isa { Avx2, Avx512, Avx512Bf16, Amx };

std::string_view isa_name(Isa isa);  // "avx2", "avx512", "avx512_bf16", "amx"
// Parses an isa_name; false for anything else.
bool isa_from_name(std::string_view name, Isa* isa);
// The highest level this CPU and operating system run (cpu_features).
Isa cpu_isa();
// The level `name` names, at most cpu_isa(); else std::invalid_argument "<source>: not a level
// this CPU runs (avx2 up to ...)", source being what the user wrote (CPUTRAIN_ISA=x, --isa x).
Isa isa_level(std::string_view name, std::string_view source);
struct CpuFeatures;
// Whether the CPU's vdpbf16ps is known to retire fewer FLOPs than its FP32 FMA: an Intel core with
// AVX512_FP16 (Sapphire Rapids and after) whose AMX is not offered, as in a VM that hides it (half
// the FMA's rate, measured on family 6 model 207). Zen 4 and 5 (twice the FMA's rate) have no
// AVX512_FP16, nor Cooper Lake.
bool vdpbf16ps_slower_than_fma(const CpuFeatures& f);
// The level kernels take when nothing sets one: `top` (cpu_isa()), except avx512 where the top is
// avx512_bf16 and vdpbf16ps is slower than the FMA: there bf16 products run faster widened to FP32
// as the GEMM packs them, and FP32 attention too. Decided from cpuid alone, so every rank and
// every resume of a run on the machine takes the same kernels.
Isa default_isa_level(Isa top, bool slow_vdpbf16ps);
// Where the default level is below cpu_isa() and is the ceiling, why, for the start-up log; else
// empty.
std::string isa_default_note();
// The highest level kernels may use: the default level above, or the one CPUTRAIN_ISA or
// set_isa_ceiling sets (any level up to cpu_isa()). Throws std::invalid_argument for a
// CPUTRAIN_ISA that is not a level.
Isa isa_ceiling();
// Lowers (or restores) the ceiling for families that have not chosen yet; throws
// std::invalid_argument above cpu_isa().
void set_isa_ceiling(Isa isa);
// Whether code that needs `isa` may run: at or below the ceiling.
bool isa_usable(Isa isa);

// One implementation in a family's table.
struct KernelRow {
  std::string_view name;      // what CPUTRAIN_<FAMILY> and --kernel take
  Isa needs;                  // the level it runs at
  bool by_default = true;     // false: only when forced (a reference, another library)
  bool (*check)() = nullptr;  // a run-time check beyond the level (a self-test), or none
};

// Whether this CPU runs the row: its level is usable and its check passes.
bool kernel_row_usable(const KernelRow& row);
// The index of the row `family` takes (see above), recorded for kernel_choices(). Throws
// std::invalid_argument, naming the variable or flag and the rows this CPU runs, for a forced
// name that is not in the table or that this CPU cannot run.
std::size_t choose_kernel_row(std::string_view family, std::span<const KernelRow> rows);
// The names of the rows this CPU runs, e.g. "amx, avx512, eigen, onednn, reference".
std::string usable_kernel_rows(std::span<const KernelRow> rows);
// A row of a family's table: the implementation and its entry (a table of functions).
template <typename Entry>
struct KernelChoice {
  KernelRow row;
  Entry entry;
};
// The rows of a table, for the functions above.
template <typename Entry, std::size_t N>
std::array<KernelRow, N> kernel_rows(const KernelChoice<Entry> (&table)[N]) {
  std::array<KernelRow, N> rows;
  for (std::size_t i = 0; i < N; ++i) rows[i] = table[i].row;
  return rows;
}
// The row of `table` that `family` takes. A family calls it once and keeps the result.
template <typename Entry, std::size_t N>
const KernelChoice<Entry>& choose_kernel(std::string_view family,
                                         const KernelChoice<Entry> (&table)[N]) {
  return table[choose_kernel_row(family, kernel_rows(table))];
}

// Forces `family` to the row `name`, as CPUTRAIN_<FAMILY> does and before it, for a family that
// has not chosen yet (the CLI calls it before any kernel runs; std::logic_error after). `source`
// is what the user wrote, for messages (default "--kernel family=name"). Throws
// std::invalid_argument for a family that is not one of kernel_families().
void force_kernel(std::string_view family, std::string_view name, std::string_view source = {});
// "gemm, attention, swiglu, cross_entropy, deltanet, peak".
std::string kernel_families();
// Makes every family choose now and names the choices: "gemm amx, attention amx, swiglu
// avx512, cross_entropy avx512, deltanet avx512, peak amx". Throws what choose_kernel_row throws.
std::string kernel_choices();

}  // namespace cputrain::kernels
