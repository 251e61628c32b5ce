// tidespec::exact_attention: the row-invariant CPU attention (packed_linear, once here: exact_linear.cpp).
//
// Why this exists: greedy speculative decoding is lossless only if a verification forward (k rows
// per sequence) computes each row's logits bit for bit as a decode forward (1 row) does, and
// batching must not change a row either. PyTorch's CPU SDPA does not give that: it multiplies
// blocks of query rows by blocks of keys with BLAS GEMMs whose summation order depends on how many
// rows and keys the call holds (the K-blocking of P @ V, the vector body vs the scalar tail of the
// softmax), so a row's output depends on its neighbours in the call and on the padded key length.
// No library offers a CPU attention whose per-row arithmetic is fixed, so this one is written for
// that property first, speed second:
//
//   * a row sees exactly the keys its mask marks visible; padding keys, padding rows and other
//     sequences never enter its arithmetic;
//   * every score q . k is one fma chain over the head dim, d = 0, 1, ..., hd-1, in one lane of a
//     vector of VL keys (the key cache is stored transposed, [hd, L] per head, so VL consecutive
//     keys are one load): a score's bits do not depend on the lane or the tile it is computed in;
//   * the softmax runs over the row's visible keys in rank order (its m-th visible key is element
//     m): the sum in VL partial sums (lane m mod VL) folded by a fixed tree; P @ V sums each output
//     element over the visible keys in rank order;
//   * every element goes through the same vector code (a tail is a partial vector, never a scalar
//     loop), so its exp, its products and its sums do not depend on where it falls in a call;
//   * fma only where written (vec::fmadd); the file is compiled with -ffp-contract=off.
// Tiling (which rows and heads share a task, how many keys a tile holds) changes only which
// independent lanes are computed together, never the order of any row's operations.
//
// Paged caches: with a block table ([S, nb] int64), the caches are pools of blocks [NB, n_kv, bs,
// hd] and position p of slot s lives in block table[s][p / bs] at row p % bs; without one, slot s is
// one block of the whole length (table [s]). The blocks only change where a key or value is loaded
// from: every score, exp and sum is the same operation in the same order, so a paged row has the
// bits of the same row in a contiguous slot. bs is a multiple of VL, so a vector of VL consecutive
// keys never straddles two blocks.
//
// A tree's tokens sit in the cache in breadth-first order, so a token's visible ancestors come in
// the same rank order as in a chain: a token verified in a tree gets the bits of a chain.
//
// softcap > 0 (Gemma 2): each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
// sinks (gpt-oss, [n_h]): each head's learned logit joins the softmax's max and its denominator and
// adds no value: out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)), m the max of the
// scores and the sink. Per head, the same in every call: a row's bits still depend on nothing else.
//
// Worked example (one head, hd = 2, two visible keys, scale 1):
//   q = [1, 0], keys [[1, 0], [0, 1]], values [[2, 0], [0, 4]]
//   scores [1, 0] -> max 1 -> e = [1, exp(-1)] -> sum 1.3679 -> out = (1*[2,0] + 0.3679*[0,4]) / 1.3679
//                                                                  = [1.4621, 1.0758]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();  // keys per score vector; lanes of the softmax sum
constexpr int64_t RB = 16;           // query vectors (rows x heads of one KV head) per task, at most
constexpr int64_t KT = 64;           // keys per P @ V tile (their values stay in L1 across the task's vectors)

// VL floats of ``src`` from ``count`` elements (the rest 0), as one vector.
template <typename scalar_t>
inline Vec load(const scalar_t* src, int64_t count) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return count == VL ? Vec::loadu(src) : Vec::loadu(src, count);
  } else {
    Vec out;
    if (count == VL) {
      at::vec::load_to_float<scalar_t>(src, out);
    } else {
      alignas(64) float buf[VL] = {};
      for (int64_t l = 0; l < count; ++l) buf[l] = static_cast<float>(src[l]);
      out = Vec::loadu(buf);
    }
    return out;
  }
}

// A vector's lanes summed by a fixed tree: lane l + w into lane l, w = VL/2, ..., 1.
inline float fold_sum(const Vec& v) {
  alignas(64) float lane[VL];
  v.store(lane);
  for (int64_t w = VL / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
  }
  return lane[0];
}

inline float fold_max(const Vec& v) {  // a max is exact in any order
  alignas(64) float lane[VL];
  v.store(lane);
  float m = lane[0];
  for (int64_t l = 1; l < VL; ++l) m = std::max(m, lane[l]);
  return m;
}

// The index of a mask row's last visible key (-1 if none), scanning back 8 keys at a time (a prompt
// chunk's causal rows end far before the row's end; the scan is only a search, no arithmetic).
inline int64_t last_visible(const bool* mrow, int64_t n) {
  int64_t j = n;
  while (j >= 8) {
    uint64_t word;
    std::memcpy(&word, mrow + j - 8, sizeof(word));
    if (word != 0) break;
    j -= 8;
  }
  while (j > 0 && !mrow[j - 1]) --j;
  return j - 1;
}

// Where position p of one slot's keys or values lives, in elements from the cache's start (plus the
// head's offset): block table[p / bs], row p % bs of it.
struct Pages {
  const int64_t* table;  // the slot's blocks (a contiguous cache: the slot itself, one block)
  int64_t bs;            // positions per block
  int64_t block_stride;  // elements between blocks
  int64_t pos_stride;    // elements between positions within a block
  inline int64_t at(int64_t p) const { return table[p / bs] * block_stride + (p % bs) * pos_stride; }
};

struct Task {
  const int64_t* table;  // the slot's block table row (a contiguous cache: the slot)
  int64_t head0;  // first query head
  int64_t heads;  // query heads (all of one KV head's group, or one)
  int64_t row0;   // first row (into q / mask / out)
  int64_t rows;   // consecutive rows of the same slot
};

// Scores of R query vectors (qv, [hd, R]: element d of every vector together) against keys [0, nk)
// of one KV head: each VL keys get one fma chain over d per lane, in tiles of KT keys that lie in up
// to KT / VL blocks; the next tile's rows are prefetched meanwhile (a page away, where no hardware
// prefetcher looks). R is a template argument so the accumulators stay in registers.
//   R > 4: a tile is first copied into ``kbuf`` ([hd, KT] float, L1-resident), then each VL keys of it
//     go through the d loop with their R chains.
//   R <= 4 (a decode row's heads): R chains alone would wait on the fma latency (R = 1: one fma per
//     latency), so the tile's KT / VL key vectors go through the d loop together, read where the cache
//     holds them, each once (measured slower with more vectors: the R > 4 way stays).
// A lane's chain is the same whichever way computes it.
template <int64_t R, typename scalar_t>
void score_tiles(const float* qv, const scalar_t* kb, const Pages& kp, int64_t kd, int64_t hd, int64_t nk,
                 int64_t kv_pad, float scale, float softcap, float* kbuf, float* scores) {
  constexpr int64_t U = KT / VL;  // key vectors of a tile
  const Vec vscale(scale), vcap(softcap);
  constexpr int64_t LINE = 64 / static_cast<int64_t>(sizeof(scalar_t));  // keys per cache line
  int64_t at[U], ahead[KT / LINE + 1];  // where each VL keys of this tile (each line of the next) start
  auto store = [&](const Vec& s, int64_t i, int64_t at_key) {
    const Vec scaled = s * vscale;
    // Gemma 2's soft cap, as transformers writes it: cap * tanh(score / cap), lane by lane
    (softcap > 0.0f ? vcap * (scaled / vcap).tanh() : scaled).store(scores + i * kv_pad + at_key);
  };
  for (int64_t b0 = 0; b0 < nk; b0 += KT) {
    const int64_t bw = std::min<int64_t>(KT, nk - b0);
    const int64_t next = std::min<int64_t>(KT, nk - b0 - KT);  // keys of the next tile, if any
    for (int64_t l0 = 0; l0 < bw; l0 += VL) at[l0 / VL] = kp.at(b0 + l0);
    for (int64_t l0 = 0; l0 < next; l0 += LINE) ahead[l0 / LINE] = kp.at(b0 + KT + l0);
    if constexpr (R > 4) {
      for (int64_t d = 0; d < hd; ++d) {
        for (int64_t l0 = 0; l0 < next; l0 += LINE) __builtin_prefetch(kb + d * kd + ahead[l0 / LINE]);
        for (int64_t l0 = 0; l0 < bw; l0 += VL) {
          load(kb + d * kd + at[l0 / VL], std::min<int64_t>(VL, bw - l0)).store(kbuf + d * KT + l0);
        }
      }
      for (int64_t t0 = 0; t0 < bw; t0 += VL) {
        Vec s[R];
        for (int64_t i = 0; i < R; ++i) s[i] = Vec(0.0f);
        for (int64_t d = 0; d < hd; ++d) {
          const Vec kt = Vec::loadu(kbuf + d * KT + t0);
          const float* qd = qv + d * R;  // the R vectors' element d, adjacent: one base pointer for all R
          for (int64_t i = 0; i < R; ++i) s[i] = at::vec::fmadd(Vec(qd[i]), kt, s[i]);
        }
        for (int64_t i = 0; i < R; ++i) store(s[i], i, b0 + t0);
      }
    } else {
      const int64_t un = (bw + VL - 1) / VL;  // key vectors in this tile
      int64_t count[U];  // keys of each (a partial one's other lanes load 0)
      for (int64_t u = 0; u < U; ++u) count[u] = std::min<int64_t>(VL, bw - u * VL);
      Vec s[R][U];
      for (int64_t i = 0; i < R; ++i) {
        for (int64_t u = 0; u < U; ++u) s[i][u] = Vec(0.0f);
      }
      for (int64_t d = 0; d < hd; ++d) {
        for (int64_t l0 = 0; l0 < next; l0 += LINE) __builtin_prefetch(kb + d * kd + ahead[l0 / LINE]);
        Vec kt[U];
        for (int64_t u = 0; u < U; ++u) {
          if (u < un) kt[u] = load(kb + d * kd + at[u], count[u]);
        }
        const float* qd = qv + d * R;
        for (int64_t i = 0; i < R; ++i) {
          const Vec qi(qd[i]);
          for (int64_t u = 0; u < U; ++u) {
            if (u < un) s[i][u] = at::vec::fmadd(qi, kt[u], s[i][u]);
          }
        }
      }
      for (int64_t i = 0; i < R; ++i) {
        for (int64_t u = 0; u < un; ++u) store(s[i][u], i, b0 + u * VL);
      }
    }
  }
}

// score_tiles<R> for R = 1 .. 16 (R above 16: 16), picked from a table built at compile time.
template <typename scalar_t, std::size_t... I>
constexpr auto score_table(std::index_sequence<I...>) { return std::array{&score_tiles<I + 1, scalar_t>...}; }

template <typename scalar_t>
void score_dispatch(int64_t R, const float* qv, const scalar_t* kb, const Pages& kp, int64_t kd, int64_t hd,
                    int64_t nk, int64_t kv_pad, float scale, float softcap, float* kbuf, float* scores) {
  static constexpr auto table = score_table<scalar_t>(std::make_index_sequence<16>{});
  table[std::min<int64_t>(R, 16) - 1](qv, kb, kp, kd, hd, nk, kv_pad, scale, softcap, kbuf, scores);
}

// One query vector's softmax over its visible keys by rank: its unnormalised weight of key j goes to
// w[j] (visible j only); returns 1 / (sum of the weights).
// A row whose visible keys are the prefix [0, n) (a chain's row: its context, then its own earlier
// tokens) has rank m = key m, so its softmax runs on the scores in place: the same elements in the
// same order as the compacted copy, hence the same bits, without the gather and scatter.
inline float softmax_weights(const bool* mrow, const float* sc, int64_t nk, int64_t* rk, float* e, float* w,
                             const float* sink) {
  const void* hole = std::memchr(mrow, 0, static_cast<size_t>(nk));  // a prefix found by memchr, not byte by byte
  int64_t n = hole ? static_cast<const bool*>(hole) - mrow : nk;
  const bool prefix = n == nk || last_visible(mrow + n, nk - n) < 0;
  if (!prefix) n = std::count(mrow, mrow + nk, true);
  if (prefix) {
    e = w;  // the weights are computed where the scores were copied to, key m at element m
    std::copy(sc, sc + n, e);
  } else {
    n = 0;
    for (int64_t j = 0; j < nk; ++j) {  // branch-free compaction: rk[n] = j, n += visible
      rk[n] = j;
      n += mrow[j] ? 1 : 0;
    }
    for (int64_t m = 0; m < n; ++m) e[m] = sc[rk[m]];
  }
  const Vec ninf(-std::numeric_limits<float>::infinity());
  Vec vmax = ninf;
  for (int64_t m0 = 0; m0 < n; m0 += VL) {
    const int64_t c = std::min<int64_t>(VL, n - m0);
    vmax = at::vec::maximum(vmax, c == VL ? Vec::loadu(e + m0) : Vec::set(ninf, Vec::loadu(e + m0, c), c));
  }
  const float top = sink ? std::max(fold_max(vmax), *sink) : fold_max(vmax);
  const Vec mx(top);
  Vec vsum(0.0f);
  for (int64_t m0 = 0; m0 < n; m0 += VL) {
    const int64_t c = std::min<int64_t>(VL, n - m0);
    const Vec x = (Vec::loadu(e + m0, c) - mx).exp_u20();
    const Vec xs = c == VL ? x : Vec::set(Vec(0.0f), x, c);  // lanes past the row's keys add nothing
    xs.store(e + m0, c);
    vsum = vsum + xs;
  }
  if (!prefix) {
    for (int64_t m = 0; m < n; ++m) w[rk[m]] = e[m];
  }
  if (!n) return 0.0f;
  return sink ? 1.0f / (fold_sum(vsum) + std::exp(*sink - top)) : 1.0f / fold_sum(vsum);
}

// P @ V for R query vectors of one KV head over keys [j0, j1), into the accumulators acc [R, HV * VL]:
// keys in ascending order (= each vector's rank order); vector i adds key j only where its mask says
// visible; keys [0, all) are visible to all R, and there nothing is checked (a decode row's heads, a
// chain's rows up to the first row's end). KC VL-wide columns of the head dim at a time (R x KC
// accumulators: R x HV of them at once were kept on the stack by the compiler, from 16 on), a value
// row loaded once per chunk; the rows (vrows[j - j0], float: in the cache, else converted in ``vbuf``)
// stay in L1 across the chunks. Every accumulator sees the same operations in the same order as a
// row-at-a-time loop would.
// Keys [ja, jb) of pv_tile's key loop into its accumulators a [R][KC] (columns k0 .. k0 + kn - 1);
// CHECK: vector i adds key j only where its mask row says visible. A function of its own, inlined with
// every index a constant, so the accumulators stay in registers (as a lambda called from two loops,
// GCC kept them on the stack from R = 3 on: every fma waited on a store and a load).
template <int64_t R, int64_t KC, bool CHECK>
__attribute__((always_inline)) inline void pv_keys(Vec (&a)[R][KC], int64_t kn, const bool* const* mrows,
                                                   const float* w, int64_t kv_pad, int64_t j0, int64_t ja,
                                                   int64_t jb, const float* const* vrows, int64_t k0, int64_t hd) {
  for (int64_t j = ja; j < jb; ++j) {
    Vec v[KC];
#pragma GCC unroll 8
    for (int64_t c = 0; c < KC; ++c) {
      if (c < kn) v[c] = load(vrows[j - j0] + (k0 + c) * VL, std::min<int64_t>(VL, hd - (k0 + c) * VL));
    }
#pragma GCC unroll 16
    for (int64_t i = 0; i < R; ++i) {
      if (CHECK && !mrows[i][j]) continue;
      const Vec p(w[i * kv_pad + j]);
#pragma GCC unroll 8
      for (int64_t c = 0; c < KC; ++c) {
        if (c < kn) a[i][c] = at::vec::fmadd(p, v[c], a[i][c]);
      }
    }
  }
}

template <int64_t R, int64_t HV>
void pv_tile(const bool* const* mrows, const float* w, int64_t kv_pad, int64_t j0, int64_t j1, int64_t all,
             const float* const* vrows, int64_t hd, float* acc) {
  constexpr int64_t KC = std::max<int64_t>(1, std::min<int64_t>(HV, 8 / R));
  const int64_t js = std::min(j1, std::max(j0, all));  // keys [j0, js) need no check
  for (int64_t k0 = 0; k0 < HV; k0 += KC) {
    const int64_t kn = std::min<int64_t>(KC, HV - k0);  // columns in this chunk
    Vec a[R][KC];
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t c = 0; c < KC; ++c) {
        if (c < kn) a[i][c] = Vec::loadu(acc + (i * HV + k0 + c) * VL);
      }
    }
    pv_keys<R, KC, false>(a, kn, mrows, w, kv_pad, j0, j0, js, vrows, k0, hd);
    pv_keys<R, KC, true>(a, kn, mrows, w, kv_pad, j0, js, j1, vrows, k0, hd);
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t c = 0; c < KC; ++c) {
        if (c < kn) a[i][c].store(acc + (i * HV + k0 + c) * VL);
      }
    }
  }
}

// R query vectors: key tiles of KT, within a tile groups of G vectors (pv_tile's accumulators, a value
// and a weight in registers); then each output row scaled by its 1 / sum. open[i]: vector i's first
// key it may not see (nk if none). A bfloat16 / half tile's values are converted to float
// once into ``vbuf`` ([KT, HV * VL]), not once per group.
template <int64_t HV, typename scalar_t>
void pv_groups(int64_t R, const bool* const* mrows, const float* w, int64_t kv_pad, const float* inv,
               const int64_t* open, int64_t nk, const scalar_t* vb, const Pages& vp, int64_t hd, float* acc,
               float* vbuf, scalar_t* const* orows) {
  constexpr int64_t G = 8;
  std::fill(acc, acc + R * HV * VL, 0.0f);
  const float* vrows[KT];
  constexpr int64_t LINE = 64 / static_cast<int64_t>(sizeof(scalar_t));  // elements per cache line
  for (int64_t j0 = 0; j0 < nk; j0 += KT) {
    const int64_t j1 = std::min<int64_t>(nk, j0 + KT);
    // key j at row j % bs of block table[j / bs], walked without a division per key; the next tile's
    // value rows are prefetched (in other blocks: no hardware prefetcher follows)
    int64_t blk = j0 / vp.bs, off = j0 % vp.bs;
    const int64_t ahead_end = std::min<int64_t>(nk, j1 + KT);
    for (int64_t j = j1, b = blk + KT / vp.bs, o = off + KT % vp.bs; j < ahead_end; ++j) {
      if (o >= vp.bs) {
        o -= vp.bs;
        ++b;
      }
      const scalar_t* ahead = vb + vp.table[b] * vp.block_stride + o * vp.pos_stride;
      for (int64_t l = 0; l < hd; l += LINE) __builtin_prefetch(ahead + l);
      ++o;
    }
    for (int64_t j = j0; j < j1; ++j, ++off) {
      if (off == vp.bs) {
        off = 0;
        ++blk;
      }
      const scalar_t* src = vb + vp.table[blk] * vp.block_stride + off * vp.pos_stride;
      if constexpr (std::is_same_v<scalar_t, float>) {
        vrows[j - j0] = src;
      } else {
        float* dst = vbuf + (j - j0) * HV * VL;
        for (int64_t k = 0; k < HV; ++k) load(src + k * VL, std::min<int64_t>(VL, hd - k * VL)).store(dst + k * VL);
        vrows[j - j0] = dst;
      }
    }
    for (int64_t i0 = 0; i0 < R; i0 += G) {
      const int64_t r = std::min<int64_t>(G, R - i0);
      const float* wi = w + i0 * kv_pad;
      float* ai = acc + i0 * HV * VL;
      const bool* const* mi = mrows + i0;
      const int64_t all = *std::min_element(open + i0, open + i0 + r);
      auto run = [&](auto rows) {
        constexpr int64_t RR = decltype(rows)::value;
        pv_tile<RR, HV>(mi, wi, kv_pad, j0, j1, all, vrows, hd, ai);
      };
      switch (r) {
        case 1: run(std::integral_constant<int64_t, 1>{}); break;
        case 2: run(std::integral_constant<int64_t, 2>{}); break;
        case 3: run(std::integral_constant<int64_t, 3>{}); break;
        case 4: run(std::integral_constant<int64_t, 4>{}); break;
        case 5: run(std::integral_constant<int64_t, 5>{}); break;
        case 6: run(std::integral_constant<int64_t, 6>{}); break;
        case 7: run(std::integral_constant<int64_t, 7>{}); break;
        default: run(std::integral_constant<int64_t, G>{}); break;
      }
    }
  }
  alignas(64) float out[VL];
  for (int64_t i = 0; i < R; ++i) {
    const Vec vinv(inv[i]);
    for (int64_t k = 0; k < HV; ++k) {
      (Vec::loadu(acc + (i * HV + k) * VL) * vinv).store(out);
      const int64_t c = std::min<int64_t>(VL, hd - k * VL);
      for (int64_t l = 0; l < c; ++l) orows[i][k * VL + l] = static_cast<scalar_t>(out[l]);
    }
  }
}

template <typename scalar_t, std::size_t... I>
constexpr auto pv_table(std::index_sequence<I...>) { return std::array{&pv_groups<I + 1, scalar_t>...}; }

template <typename scalar_t>
void pv_dispatch(int64_t R, const bool* const* mrows, const float* w, int64_t kv_pad, const float* inv,
                 const int64_t* open, int64_t nk,
                 const scalar_t* vb, const Pages& vp, int64_t hd, float* acc, float* vbuf, scalar_t* const* orows) {
  static constexpr auto table = pv_table<scalar_t>(std::make_index_sequence<8>{});  // pv_groups<HV>, HV = 1 .. 8
  const int64_t hv = (hd + VL - 1) / VL;
  TORCH_CHECK(hv <= 8, "exact_attention: head size ", hd, " above ", 8 * VL);
  table[hv - 1](R, mrows, w, kv_pad, inv, open, nk, vb, vp, hd, acc, vbuf, orows);
}

template <typename scalar_t>
void attend_float(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& mask,
                  const std::vector<Task>& tasks, float scale, float softcap, const float* sinks, at::Tensor& out) {
  const int64_t n_h = q.size(1), hd = q.size(2);
  const int64_t group = n_h / k_cache.size(1), kv_len = mask.size(1);
  const int64_t kv_pad = (kv_len + VL - 1) / VL * VL;
  const scalar_t* qd = q.data_ptr<scalar_t>();
  const scalar_t* kd = k_cache.data_ptr<scalar_t>();
  const scalar_t* vd = v_cache.data_ptr<scalar_t>();
  const bool* md = mask.data_ptr<bool>();
  scalar_t* od = out.data_ptr<scalar_t>();
  // keys [S or NB, n_kv, L or bs, hd] stored transposed (positions contiguous, the head dim strided by k_d)
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), k_d = k_cache.stride(3);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t bs = k_cache.size(2);

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    // per-thread scratch kept across calls (ATen's parallel_for has no per-thread storage), grown when needed,
    // never zeroed: every element is written before it is read (a weight only for keys its row sees, the only
    // ones read). Allocating and zeroing 2 x 16 x kv_pad floats per call cost 256 KB a thread at 2,000 keys.
    thread_local std::vector<float> qv, scores, weights, e, acc, kbuf, vbuf;
    thread_local std::vector<int64_t> rank;
    auto fit = [](auto& v, int64_t n) { if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n)); };
    fit(qv, RB * hd);
    fit(scores, RB * kv_pad);
    fit(weights, RB * kv_pad);
    fit(e, kv_pad + VL);
    fit(acc, RB * ((hd + VL - 1) / VL) * VL);
    fit(kbuf, hd * KT);
    fit(vbuf, KT * ((hd + VL - 1) / VL) * VL);
    fit(rank, kv_pad + 1);
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& task = tasks[ti];
      const int64_t R = task.rows * task.heads;  // query vectors, row-major over (row, head)
      const int64_t g = task.head0 / group;
      const scalar_t* kb = kd + g * ks1;  // the head's keys in block 0; Pages adds the block and the row
      const scalar_t* vb = vd + g * vs1;
      const Pages kp{task.table, bs, ks0, 1}, vp{task.table, bs, vs0, vs2};
      int64_t nk = 0;  // keys up to the last one any row of the task sees
      for (int64_t r = 0; r < task.rows; ++r) nk = std::max(nk, last_visible(md + (task.row0 + r) * kv_len, kv_len) + 1);
      for (int64_t i = 0; i < R; ++i) {
        const int64_t row = task.row0 + i / task.heads, h = task.head0 + i % task.heads;
        for (int64_t d = 0; d < hd; ++d) qv[d * R + i] = static_cast<float>(qd[(row * n_h + h) * hd + d]);
      }
      score_dispatch(R, qv.data(), kb, kp, k_d, hd, nk, kv_pad, scale, softcap, kbuf.data(), scores.data());
      const bool* mrows[RB];
      scalar_t* orows[RB];
      float inv[RB];
      int64_t open[RB];
      for (int64_t i = 0; i < R; ++i) {
        const int64_t row = task.row0 + i / task.heads, h = task.head0 + i % task.heads;
        mrows[i] = md + row * kv_len;
        orows[i] = od + (row * n_h + h) * hd;
        inv[i] = softmax_weights(mrows[i], scores.data() + i * kv_pad, nk, rank.data(), e.data(),
                                 weights.data() + i * kv_pad, sinks ? sinks + h : nullptr);
        const void* hidden = std::memchr(mrows[i], 0, static_cast<size_t>(nk));
        open[i] = hidden ? static_cast<const bool*>(hidden) - mrows[i] : nk;
      }
      pv_dispatch(R, mrows, weights.data(), kv_pad, inv, open, nk, vb, vp, hd, acc.data(), vbuf.data(), orows);
    }
  });
}

// float64 (the tests' reference dtype): the same visiting order, plain scalar loops; ``tables[t]`` is
// row t's block table row (a contiguous cache: its slot).
void attend_double(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& mask,
                   const std::vector<const int64_t*>& tables, double scale, double softcap, const double* sinks,
                   at::Tensor& out) {
  const int64_t T = q.size(0), n_h = q.size(1), hd = q.size(2);
  const int64_t group = n_h / k_cache.size(1), kv_len = mask.size(1), bs = k_cache.size(2);
  const auto qa = q.accessor<double, 3>();
  const auto ma = mask.accessor<bool, 2>();
  auto oa = out.accessor<double, 3>();
  const double* kd = k_cache.data_ptr<double>();
  const double* vd = v_cache.data_ptr<double>();
  const int64_t ks1 = k_cache.stride(1), k_d = k_cache.stride(3), vs1 = v_cache.stride(1), v_d = v_cache.stride(3);
  at::parallel_for(0, T * n_h, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> s(kv_len);
    std::vector<int64_t> rk(kv_len);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / n_h, h = task % n_h, g = h / group;
      const Pages kp{tables[t], bs, k_cache.stride(0), k_cache.stride(2)};
      const Pages vp{tables[t], bs, v_cache.stride(0), v_cache.stride(2)};
      int64_t n = 0;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < kv_len; ++j) {
        if (!ma[t][j]) continue;
        const double* kj = kd + kp.at(j) + g * ks1;
        double dot = 0;
        for (int64_t d = 0; d < hd; ++d) dot = std::fma(qa[t][h][d], kj[d * k_d], dot);
        rk[n] = j;
        s[n] = softcap > 0.0 ? softcap * std::tanh(dot * scale / softcap) : dot * scale;
        mx = std::max(mx, s[n++]);
      }
      if (sinks) mx = std::max(mx, sinks[h]);
      double sum = 0;
      for (int64_t m = 0; m < n; ++m) sum += (s[m] = std::exp(s[m] - mx));
      if (sinks) sum += std::exp(sinks[h] - mx);
      for (int64_t d = 0; d < hd; ++d) {
        double a = 0;
        for (int64_t m = 0; m < n; ++m) a = std::fma(s[m], vd[vp.at(rk[m]) + g * vs1 + d * v_d], a);
        oa[t][h][d] = n ? a / sum : 0.0;
      }
    }
  });
}

at::Tensor exact_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slots, const at::Tensor& mask, double scale,
                           const std::optional<at::Tensor>& block_table, double softcap,
                           const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "exact_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "q [T, n_h, hd], caches [S, n_kv, L, hd] (paged: [NB, n_kv, bs, hd])");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(2) == v_cache.size(3), "head sizes differ");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "the key and value caches differ in shape");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == q.size(0), "mask [T, kv_len] bool");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == q.size(0), "slots [T] int64");
  const bool paged = block_table.has_value();
  at::Tensor bt;
  const int64_t bs = k_cache.size(2);
  if (paged) {
    bt = block_table->contiguous();
    TORCH_CHECK(bt.scalar_type() == at::kLong && bt.dim() == 2, "block_table [S, nb] int64");
    TORCH_CHECK(mask.size(1) <= bt.size(1) * bs, "mask longer than the block table covers");
    TORCH_CHECK(q.scalar_type() == at::kDouble || bs % VL == 0, "block size ", bs, " is not a multiple of ", VL);
  } else {
    TORCH_CHECK(mask.size(1) <= bs, "mask longer than the cache");
  }
  if (sinks.has_value()) TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), "sinks [n_h]");
  const bool dbl = q.scalar_type() == at::kDouble;
  const at::Tensor sk = sinks.has_value() ? sinks->to(dbl ? at::kDouble : at::kFloat).contiguous() : at::Tensor();
  const float* sinks_f = sinks.has_value() && !dbl ? sk.data_ptr<float>() : nullptr;
  at::Tensor qc = q.contiguous(), mc = mask.contiguous(), sc = slots.contiguous();
  at::Tensor out = at::empty_like(qc);
  const int64_t T = q.size(0), n_kv = k_cache.size(1), group = q.size(1) / n_kv;
  const int64_t* sd = sc.data_ptr<int64_t>();
  const int64_t rows = paged ? bt.size(0) : k_cache.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sd[t] >= 0 && sd[t] < rows, "slot ", sd[t], " outside [0, ", rows, ")");
  // row t's block table row; a contiguous cache's slot s is the one block s of the whole length
  auto table = [&](int64_t t) { return paged ? bt.data_ptr<int64_t>() + sd[t] * bt.stride(0) : sd + t; };
  if (q.scalar_type() == at::kDouble) {  // reference path
    std::vector<const int64_t*> tables(T);
    for (int64_t t = 0; t < T; ++t) tables[t] = table(t);
    attend_double(qc, k_cache, v_cache, mc, tables, scale, softcap, sinks.has_value() ? sk.data_ptr<double>() : nullptr,
                  out);
    return out;
  }
  TORCH_CHECK(k_cache.stride(2) == 1, "the key cache must be stored transposed ([S, n_kv, hd, L] in memory)");
  TORCH_CHECK(v_cache.stride(3) == 1, "the value cache's head dim must be contiguous");
  TORCH_CHECK(group <= RB, "more than ", RB, " query heads per KV head");
  // tasks: runs of consecutive rows of one slot x KV heads, the group's heads split only with fewer tasks than
  // threads (split below 4x, a 2-thread decode of 3 KV heads read K and V thrice and ran 1.3-1.6x slower)
  int64_t runs = 0;
  for (int64_t t = 0; t < T; ++t) runs += (t == 0 || sd[t] != sd[t - 1]) ? 1 : 0;
  const bool split_heads = runs * n_kv < at::get_num_threads();
  const int64_t heads = split_heads ? 1 : group;
  const int64_t rows_per_task = std::max<int64_t>(1, RB / heads);
  std::vector<Task> tasks;
  for (int64_t t = 0; t < T;) {
    int64_t n = 1;
    while (t + n < T && n < rows_per_task && sd[t + n] == sd[t]) ++n;
    for (int64_t h = 0; h < q.size(1); h += heads) tasks.push_back({table(t), h, heads, t, n});
    t += n;
  }
  switch (q.scalar_type()) {
    case at::kFloat: attend_float<float>(qc, k_cache, v_cache, mc, tasks, static_cast<float>(scale),
                                         static_cast<float>(softcap), sinks_f, out); break;
    case at::kBFloat16: attend_float<at::BFloat16>(qc, k_cache, v_cache, mc, tasks, static_cast<float>(scale),
                                                   static_cast<float>(softcap), sinks_f, out); break;
    case at::kHalf: attend_float<at::Half>(qc, k_cache, v_cache, mc, tasks, static_cast<float>(scale),
                                           static_cast<float>(softcap), sinks_f, out); break;
    default: TORCH_CHECK(false, "exact_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidespec, m) {
  m.def("exact_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor mask, float scale, "
        "Tensor? block_table=None, float softcap=0.0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidespec, CPU, m) {
  m.impl("exact_attention", &exact_attention);
}
