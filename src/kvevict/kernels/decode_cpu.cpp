// Fused decode attention over packed or dense key/value runs (kvevict.kernels.cpu builds this at
// first use). One task per (sequence, KV head): the g query heads of the KV head are handled
// together, so every stored key and value is read once. Two passes, each over its own data:
//   1. keys: unpack a key's codes and dequantize them (step * code + zero) into a d-float buffer
//      that stays in L1, then its dot with the g queries -> the scores (g x n floats);
//   2. softmax of the saved scores, then values: dequantized the same way, out += p * v_hat, and
//      pg = sum over the g heads of p (what the cache's statistics are built from).
// No dequantized copy of the cache is ever written.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

enum Kind { P8 = 0, P4 = 1, P2 = 2, F32 = 3, F16 = 4, BF16 = 5 };

struct Part {  // the keys or the values of one run
  const uint8_t* data;  // codes (uint8) or dense rows
  int64_t s0, s1, s2;   // strides (batch, head, slot) in elements
  const uint8_t* zero; int64_t z0, z1, z2;  // zero bytes z: zero = -z * step / 2^(8 - bits)
  const uint8_t* step; int64_t t0, t1, t2;  // step bytes (kvevict.storage.codes.step_value)
  // paged (kvevict.storage.paged): the tensors are pools (pages, head, slot in page, ...), s0/z0/t0 the page
  // strides, and row b's slot i is slot i % page of page tab[b * tb + i / page]; null: not paged
  const int64_t* tab = nullptr; int64_t tb = 0, page = 1, pshift = -1;  // pshift: log2(page), or -1
};

// (row, slot) -> (page, slot in page) for a paged part; unchanged otherwise
inline void locate(const Part& p, int64_t& b, int64_t& i) {
  if (p.tab) {
    const int64_t q = p.pshift >= 0 ? i >> p.pshift : i / p.page;  // a shift for pages of 2^k slots
    i -= q * p.page;
    b = p.tab[b * p.tb + q];
  }
}

constexpr int32_t STEP_BASE = (127 - 16) << 23;  // kvevict.storage.codes.STEP_BIAS

// a step byte as the float it stands for: the top 11 bits of a float32 (exponent, 3 mantissa bits)
inline float step_of(uint8_t u) {
  const int32_t b = (static_cast<int32_t>(u) << 20) + STEP_BASE;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

struct RunView {
  int kind, group;
  int64_t n, heads;
  Part k, v;
};

inline float h2f(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// exp for the softmax, vectorizable (Cephes' exp2f polynomial, relative error ~2e-7); exactly 0
// below -87.3 (and for -inf, the masked keys), so a masked key's probability is exactly zero.
inline float fast_exp(float x) {
  float t = x * 1.4426950408889634f;
  t = t < -126.f ? -126.f : (t > 126.f ? 126.f : t);
  const float fn = std::floor(t + 0.5f);
  const float f = t - fn;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t e = (static_cast<int32_t>(fn) + 127) << 23;
  float s;
  std::memcpy(&s, &e, 4);
  return x < -87.3f ? 0.f : p * s;
}

// Row i of a part as d floats: a pointer into the storage (fp32), or ``buf`` filled in place.
template <int KIND, int D>
inline const float* row(const Part& p, int64_t b, int64_t h, int64_t i, int d_rt, int group, float* buf) {
  locate(p, b, i);
  const int d = D ? D : d_rt;
  const int64_t off = b * p.s0 + h * p.s1 + i * p.s2;
  if constexpr (KIND == F32) {
    return reinterpret_cast<const float*>(p.data) + off;
  } else if constexpr (KIND == F16) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(p.data) + off;
    int j = 0;
#if defined(__F16C__)
    for (; j + 8 <= d; j += 8)
      _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j))));
#endif
    for (; j < d; ++j) buf[j] = h2f(x[j]);
    return buf;
  } else if constexpr (KIND == BF16) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(p.data) + off;
#pragma omp simd
    for (int j = 0; j < d; ++j) {
      const uint32_t u = static_cast<uint32_t>(x[j]) << 16;
      std::memcpy(buf + j, &u, 4);
    }
    return buf;
  } else {
    constexpr int BITS = KIND == P8 ? 8 : (KIND == P4 ? 4 : 2);
    constexpr int PER = 8 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1;
    const int w = d / PER;  // byte j holds channels j, j + w, j + 2w, ...
    const uint8_t* c = p.data + off;
    for (int k = 0; k < PER; ++k) {
      float* dst = buf + k * w;
#pragma omp simd
      for (int j = 0; j < w; ++j) dst[j] = static_cast<float>((c[j] >> (BITS * k)) & MASK);
    }
    const uint8_t* z = p.zero + b * p.z0 + h * p.z1 + i * p.z2;
    const uint8_t* s = p.step + b * p.t0 + h * p.t1 + i * p.t2;
    const int ng = d / group;
    constexpr float UNIT = 1.f / (1 << (8 - BITS));  // a zero byte's share of a step
    for (int gi = 0; gi < ng; ++gi) {
      // code * step + zero in one fma: both terms and the sum are exact in fp32 (kvevict.storage.codes.dequantize)
      const float ss = step_of(s[gi]), zz = -static_cast<float>(z[gi]) * (ss * UNIT);
      float* x = buf + gi * group;
#pragma omp simd
      for (int j = 0; j < group; ++j) x[j] = x[j] * ss + zz;
    }
    return buf;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVEVICT_AVX512 1
// Row i of a part as D / 16 vectors, in registers (D a multiple of 64 for 2-bit codes, of 32 for
// 4-bit; a group a multiple of 16 channels, so one vector lies in one group).
template <int KIND, int D>
inline void row_vec(const Part& p, int64_t b, int64_t h, int64_t i, int gshift, __m512* x) {
  locate(p, b, i);
  constexpr int NV = D / 16;
  const int64_t off = b * p.s0 + h * p.s1 + i * p.s2;
  if constexpr (KIND == F32) {
    const float* r = reinterpret_cast<const float*>(p.data) + off;
    for (int v = 0; v < NV; ++v) x[v] = _mm512_loadu_ps(r + 16 * v);
  } else if constexpr (KIND == F16) {
    const uint16_t* r = reinterpret_cast<const uint16_t*>(p.data) + off;
    for (int v = 0; v < NV; ++v)
      x[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * v)));
  } else if constexpr (KIND == BF16) {
    const uint16_t* r = reinterpret_cast<const uint16_t*>(p.data) + off;
    for (int v = 0; v < NV; ++v)
      x[v] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * v))), 16));
  } else {
    const uint8_t* c = p.data + off;
    auto bytes = [&](int u) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * u))); };
    if constexpr (KIND == P8) {
      for (int v = 0; v < NV; ++v) x[v] = _mm512_cvtepi32_ps(bytes(v));
    } else if constexpr (KIND == P4) {  // byte j: channel j (low nibble), channel j + D/2 (high)
      constexpr int H = NV / 2;
      const __m512i m = _mm512_set1_epi32(15);
      for (int u = 0; u < H; ++u) {
        const __m512i by = bytes(u);
        x[u] = _mm512_cvtepi32_ps(_mm512_and_si512(by, m));
        x[H + u] = _mm512_cvtepi32_ps(_mm512_srli_epi32(by, 4));
      }
    } else {  // 2 bits: byte j holds channels j, j + D/4, j + D/2, j + 3D/4
      constexpr int Q = NV / 4;
      const __m512i m = _mm512_set1_epi32(3);
      for (int u = 0; u < Q; ++u) {
        const __m512i by = bytes(u);
        for (int k = 0; k < 4; ++k)
          x[k * Q + u] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(by, 2 * k), m));
      }
    }
    // the token's steps and zeros (D / group <= 16 of them) as vectors; lane v >> gshift is vector
    // v's group; zero = -z * step / 2^(8 - bits)
    constexpr int BITS = KIND == P8 ? 8 : (KIND == P4 ? 4 : 2);
    const __mmask16 gm = static_cast<__mmask16>((1u << (D / (16 << gshift))) - 1);
    const __m512 sv = _mm512_castsi512_ps(_mm512_add_epi32(
        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(gm, p.step + b * p.t0 + h * p.t1 + i * p.t2)), 20),
        _mm512_set1_epi32(STEP_BASE)));
    const __m512 zi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(gm, p.zero + b * p.z0 + h * p.z1 + i * p.z2)));
    const __m512 zv = _mm512_mul_ps(zi, _mm512_mul_ps(sv, _mm512_set1_ps(-1.f / (1 << (8 - BITS)))));
    for (int v = 0; v < NV; ++v) {
      const __m512i ix = _mm512_set1_epi32(v >> gshift);
      x[v] = _mm512_fmadd_ps(x[v], _mm512_permutexvar_ps(ix, sv), _mm512_permutexvar_ps(ix, zv));
    }
  }
}
#endif

struct Task {  // what one (sequence, KV head) task reads and writes
  int64_t b, kvh, N;     // N = stored slots + 1 (the new key)
  int g, d, dv;
  const float* q;        // (g, d) scaled queries of this KV head
  const bool* mask;      // this task's mask row (stride mstride), or null
  int64_t mstride, mask_n;
  float softcap;
  float* sc;             // (g, N) scores, then probabilities
  float* acc;            // (g, dv) output accumulator
  float* pg;             // (N) output
  float* buf;            // (max(d, dv)) one dequantized row
};

// log2(group / 16) when rows of this run can be read as vectors (row_vec), else -1
template <int KIND, int D>
int vector_shift(const RunView& r) {
#if defined(KVEVICT_AVX512)
  if constexpr (D > 0 && D % 64 == 0) {
    if (KIND == F32 || KIND == F16 || KIND == BF16) return 0;
    if (r.group % 16 || D % r.group || D / r.group > 16) return -1;
    int sh = 0;
    while ((16 << sh) < r.group) ++sh;
    return (16 << sh) == r.group ? sh : -1;
  }
#endif
  return -1;
}

template <int KIND, int D>
void scores_run(const Task& t, const RunView& r, int64_t off) {
  const int d = D ? D : t.d;
  const int64_t rh = r.heads == 1 ? 0 : t.kvh;
  const float ninf = -std::numeric_limits<float>::infinity();
#if defined(KVEVICT_AVX512)
  if constexpr (D > 0 && D % 64 == 0) {
    const int gshift = vector_shift<KIND, D>(r);
    if (gshift >= 0) {
      constexpr int NV = D / 16;
      for (int64_t i = 0; i < r.n; ++i) {
        const int64_t idx = off + i;
        if (t.mask && idx < t.mask_n && !t.mask[idx * t.mstride]) {
          for (int h = 0; h < t.g; ++h) t.sc[h * t.N + idx] = ninf;
          continue;
        }
        __m512 x[NV];
        row_vec<KIND, D>(r.k, t.b, rh, i, gshift, x);
        for (int h = 0; h < t.g; ++h) {
          const float* qq = t.q + h * D;
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qq), x[0]);
          for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qq + 16 * v), x[v], a);
          float s = _mm512_reduce_add_ps(a);
          if (t.softcap > 0.f) s = std::tanh(s / t.softcap) * t.softcap;
          t.sc[h * t.N + idx] = s;
        }
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < r.n; ++i) {
    const int64_t idx = off + i;
    if (t.mask && idx < t.mask_n && !t.mask[idx * t.mstride]) {
      for (int h = 0; h < t.g; ++h) t.sc[h * t.N + idx] = ninf;
      continue;  // a masked key is never read
    }
    const float* k = row<KIND, D>(r.k, t.b, rh, i, d, r.group, t.buf);
    for (int h = 0; h < t.g; ++h) {
      const float* qq = t.q + h * d;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int j = 0; j < d; ++j) s += qq[j] * k[j];
      if (t.softcap > 0.f) s = std::tanh(s / t.softcap) * t.softcap;
      t.sc[h * t.N + idx] = s;
    }
  }
}

template <int KIND, int D>
void values_run(const Task& t, const RunView& r, int64_t off) {
  const int d = D ? D : t.d;  // the caller checked dv == d
  const int64_t rh = r.heads == 1 ? 0 : t.kvh;
#if defined(KVEVICT_AVX512)
  if constexpr (D > 0 && D % 64 == 0) {
    const int gshift = vector_shift<KIND, D>(r);
    if (gshift >= 0) {
      constexpr int NV = D / 16;
      for (int64_t i = 0; i < r.n; ++i) {
        const int64_t idx = off + i;
        float tot = 0.f;
        for (int h = 0; h < t.g; ++h) tot += t.sc[h * t.N + idx];
        t.pg[idx] = tot;
        if (tot == 0.f) continue;
        __m512 x[NV];
        row_vec<KIND, D>(r.v, t.b, rh, i, gshift, x);
        for (int h = 0; h < t.g; ++h) {
          const __m512 p = _mm512_set1_ps(t.sc[h * t.N + idx]);
          float* o = t.acc + h * D;
          for (int v = 0; v < NV; ++v)
            _mm512_storeu_ps(o + 16 * v, _mm512_fmadd_ps(p, x[v], _mm512_loadu_ps(o + 16 * v)));
        }
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < r.n; ++i) {
    const int64_t idx = off + i;
    float tot = 0.f;
    for (int h = 0; h < t.g; ++h) tot += t.sc[h * t.N + idx];
    t.pg[idx] = tot;
    if (tot == 0.f) continue;  // masked (or underflowed everywhere): adds nothing
    const float* v = row<KIND, D>(r.v, t.b, rh, i, d, r.group, t.buf);
    for (int h = 0; h < t.g; ++h) {
      const float p = t.sc[h * t.N + idx];
      float* o = t.acc + h * d;
#pragma omp simd
      for (int j = 0; j < d; ++j) o[j] += p * v[j];
    }
  }
}

template <int D>
void dispatch(bool values, int kind, const Task& t, const RunView& r, int64_t off) {
#define KV_CASE(K) \
  case K: values ? values_run<K, D>(t, r, off) : scores_run<K, D>(t, r, off); break;
  switch (kind) { KV_CASE(P8) KV_CASE(P4) KV_CASE(P2) KV_CASE(F32) KV_CASE(F16) KV_CASE(BF16) }
#undef KV_CASE
}

void run_pass(bool values, const Task& t, const RunView& r, int64_t off) {
  switch (t.d) {
    case 64: dispatch<64>(values, r.kind, t, r, off); break;
    case 128: dispatch<128>(values, r.kind, t, r, off); break;
    case 256: dispatch<256>(values, r.kind, t, r, off); break;
    default: dispatch<0>(values, r.kind, t, r, off);
  }
}

Part part_of(const at::Tensor& data, const at::Tensor& zero, const at::Tensor& step) {
  Part p;
  p.data = static_cast<const uint8_t*>(data.data_ptr());
  p.s0 = data.stride(0); p.s1 = data.stride(1); p.s2 = data.stride(2);
  p.zero = static_cast<const uint8_t*>(zero.data_ptr());
  p.z0 = zero.stride(0); p.z1 = zero.stride(1); p.z2 = zero.stride(2);
  p.step = static_cast<const uint8_t*>(step.data_ptr());
  p.t0 = step.stride(0); p.t1 = step.stride(1); p.t2 = step.stride(2);
  return p;
}

// q * scale in q's dtype (one rounding there, as torch multiplies), as float32 (b * hq * d)
template <typename T>
void scale_rows(const at::Tensor& q, float scale, float* dst) {
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2);
  const T* src = static_cast<const T*>(q.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const T* row = src + b * q.stride(0) + h * q.stride(1);
      float* o = dst + (b * H + h) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = static_cast<float>(static_cast<T>(static_cast<float>(row[i]) * scale));
    }
}

std::vector<float> scaled_queries(const at::Tensor& q, float scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "decode: q must be (b, hq, d) with unit stride along d");
  std::vector<float> out(q.size(0) * q.size(1) * q.size(2));
  if (q.scalar_type() == at::kFloat)
    scale_rows<float>(q, scale, out.data());
  else if (q.scalar_type() == at::kBFloat16)
    scale_rows<c10::BFloat16>(q, scale, out.data());
  else if (q.scalar_type() == at::kHalf)
    scale_rows<c10::Half>(q, scale, out.data());
  else
    TORCH_CHECK(false, "decode: q must be float32, float16 or bfloat16");
  return out;
}

// n floats of one task's output into out (q's dtype, contiguous) from element off on
void store_out(at::Tensor& out, int64_t off, const float* src, int64_t n) {
  if (out.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>() + off, src, sizeof(float) * n);
  } else if (out.scalar_type() == at::kBFloat16) {
    c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + off;
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<c10::BFloat16>(src[i]);
  } else {
    c10::Half* o = out.data_ptr<c10::Half>() + off;
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<c10::Half>(src[i]);
  }
}

}  // namespace

// q: (b, hq, d) float32, float16 or bfloat16 with unit stride along d, unscaled: each query is
// scaled in its own dtype (rounded there, as attention in torch scales it) and read as float32.
// tensors: 6 per run (k codes|rows, k zeros, k steps, v codes|rows, v zeros, v steps; dense runs
// repeat their rows), meta: 5 per run (kind, group, n, heads, page: 0 unless paged), tables: one
// per run (int64 (b, pages) contiguous, or empty); the last run is the new key (one slot, always
// visible). mask: (b, hm, n_mask) bool with unit stride along the slots, or an empty tensor. bias:
// (b, hkv) float32 contiguous added to slot bias_at's score after the softcap (log n of the evicted
// tokens' mean slot, kvevict.merge; -inf: hidden), or an empty tensor. Returns out (b, hq, dv) in
// q's dtype and pg (b, hkv, N) float32.
std::vector<at::Tensor> decode(at::Tensor q, double scale, std::vector<at::Tensor> tensors, std::vector<int64_t> meta,
                               std::vector<at::Tensor> tables, at::Tensor mask, double softcap, int64_t hkv,
                               int64_t dv, at::Tensor bias, int64_t bias_at) {
  const int64_t B = q.size(0), hq = q.size(1), d = q.size(2), g = hq / hkv;
  const int64_t nruns = static_cast<int64_t>(meta.size()) / 5;
  std::vector<RunView> runs(nruns);
  int64_t N = 0;
  for (int64_t r = 0; r < nruns; ++r) {
    RunView& v = runs[r];
    v.kind = static_cast<int>(meta[5 * r]);
    v.group = static_cast<int>(meta[5 * r + 1]);
    v.n = meta[5 * r + 2];
    v.heads = meta[5 * r + 3];
    v.k = part_of(tensors[6 * r], tensors[6 * r + 1], tensors[6 * r + 2]);
    v.v = part_of(tensors[6 * r + 3], tensors[6 * r + 4], tensors[6 * r + 5]);
    if (meta[5 * r + 4] > 0) {
      for (Part* p : {&v.k, &v.v}) {
        p->tab = tables[r].data_ptr<int64_t>();
        p->tb = tables[r].stride(0);
        p->page = meta[5 * r + 4];
        if ((p->page & (p->page - 1)) == 0)
          for (p->pshift = 0; (int64_t{1} << p->pshift) < p->page; ++p->pshift) {}
      }
    }
    N += v.n;
  }
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out = at::empty({B, hq, dv}, q.options());
  at::Tensor pg = at::empty({B, hkv, N}, f32);
  std::vector<float> qv = scaled_queries(q, static_cast<float>(scale));
  const bool has_mask = mask.numel() > 0;
  const bool* mptr = has_mask ? mask.data_ptr<bool>() : nullptr;
  const int64_t mb = has_mask ? mask.stride(0) : 0, mh = has_mask ? mask.stride(1) : 0;
  const int64_t mn = has_mask ? mask.size(2) : 0, ms = has_mask ? mask.stride(2) : 0;
  const bool mask_per_head = has_mask && mask.size(1) > 1;
  const float* bp = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  const float* qp = qv.data();
  float* pgp = pg.data_ptr<float>();
  at::parallel_for(0, B * hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sc(g * N), acc(g * dv), buf(std::max(d, dv));
    for (int64_t task = lo; task < hi; ++task) {
      Task t;
      t.b = task / hkv; t.kvh = task % hkv; t.N = N;
      t.g = static_cast<int>(g); t.d = static_cast<int>(d); t.dv = static_cast<int>(dv);
      t.q = qp + (t.b * hq + t.kvh * g) * d;
      t.mask = has_mask ? mptr + t.b * mb + (mask_per_head ? t.kvh * mh : 0) : nullptr;
      t.mstride = ms; t.mask_n = mn;
      t.softcap = static_cast<float>(softcap);
      t.sc = sc.data(); t.acc = acc.data(); t.pg = pgp + task * N; t.buf = buf.data();
      int64_t off = 0;
      for (const RunView& r : runs) { run_pass(false, t, r, off); off += r.n; }
      if (bp)
        for (int64_t h = 0; h < g; ++h) t.sc[h * N + bias_at] += bp[task];
      for (int64_t h = 0; h < g; ++h) {  // softmax over the saved scores, in place
        float* s = t.sc + h * N;
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < N; ++i) m = s[i] > m ? s[i] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < N; ++i) { s[i] = fast_exp(s[i] - m); sum += s[i]; }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) s[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      off = 0;
      for (const RunView& r : runs) { run_pass(true, t, r, off); off += r.n; }
      store_out(out, (t.b * hq + t.kvh * g) * dv, acc.data(), g * dv);
    }
  });
  return {out, pg};
}
