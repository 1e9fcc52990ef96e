// The store path on the CPU (kvevict.kernels.store; built with decode_cpu.cpp into one module): a
// key's rotation and a token's quantization, each one pass over its rows, bit for bit the torch
// reference (kvevict.kernels.store.rotate_reference, kvevict.storage.codes.quantize). Every float
// operation is the reference's, one rounding each in the same order: a butterfly's a + b and a - b,
// x / s then + z / U. The products that are there (levels x step, -bottom x U) are exact, so a fused
// multiply-add the compiler may form rounds as the reference does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace kvevict_store {

constexpr int32_t STEP_BASE = (127 - 16) << 23;  // kvevict.storage.codes.STEP_BIAS

inline float step_value(uint8_t u) {
  const int32_t b = (static_cast<int32_t>(u) << 20) + STEP_BASE;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// the smallest step byte >= s (kvevict.storage.codes.step_byte)
inline uint8_t step_byte(float s) {
  s = s < 0.f ? 0.f : s;
  int32_t bits;
  std::memcpy(&bits, &s, 4);
  int32_t u = ((bits + ((1 << 20) - 1)) >> 20) - (STEP_BASE >> 20);
  return static_cast<uint8_t>(u < 0 ? 0 : (u > 255 ? 255 : u));
}

// c: null, or a centre (rows / per, d) in float16 that row r gives up first: x - c in x's dtype
// (c rounded to it, the difference rounded once, as torch subtracts)
template <typename T>
void rotate_rows(const T* x, T* y, int64_t rows, int64_t d, int64_t n, float scale, const c10::Half* c, int64_t per) {
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> a(n), b(n);
    for (int64_t r = lo; r < hi; ++r) {
      for (int64_t blk = 0; blk < d; blk += n) {
        const T* src = x + r * d + blk;
        if (c) {
          const c10::Half* cr = c + (r / per) * d + blk;
          for (int64_t i = 0; i < n; ++i)
            a[i] = static_cast<float>(static_cast<T>(static_cast<float>(src[i]) -
                                                     static_cast<float>(static_cast<T>(static_cast<float>(cr[i])))));
        } else {
          for (int64_t i = 0; i < n; ++i) a[i] = static_cast<float>(src[i]);
        }
        float* cur = a.data();
        float* nxt = b.data();
        for (int64_t h = 1; h < n; h *= 2) {
          for (int64_t j = 0; j < n; j += 2 * h) {
            for (int64_t i = j; i < j + h; ++i) {
              nxt[i] = cur[i] + cur[i + h];
              nxt[i + h] = cur[i] - cur[i + h];
            }
          }
          std::swap(cur, nxt);
        }
        T* dst = y + r * d + blk;
        for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(cur[i] * scale);
      }
    }
  });
}

// x (rows, d) -> (x - c) H over blocks of n channels (n a power of two dividing d), in x's dtype;
// center: empty, or float16 (rows / per, d) contiguous
at::Tensor rotate(at::Tensor x, int64_t n, double scale, at::Tensor center, int64_t per) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % n == 0, "rotate: x must be contiguous (rows, d)");
  const bool centred = center.numel() > 0;
  TORCH_CHECK(!centred || (center.scalar_type() == at::kHalf && center.is_contiguous() && per > 0 &&
                           center.numel() * per == x.numel()),
              "rotate: center must be float16 (rows / per, d), contiguous");
  at::Tensor y = at::empty_like(x);
  const int64_t rows = x.size(0), d = x.size(1);
  const float s = static_cast<float>(scale);
  const c10::Half* c = centred ? center.data_ptr<c10::Half>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    rotate_rows(x.data_ptr<float>(), y.data_ptr<float>(), rows, d, n, s, c, per);
  else if (x.scalar_type() == at::kBFloat16)
    rotate_rows(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, d, n, s, c, per);
  else if (x.scalar_type() == at::kHalf)
    rotate_rows(x.data_ptr<c10::Half>(), y.data_ptr<c10::Half>(), rows, d, n, s, c, per);
  else
    TORCH_CHECK(false, "rotate: float32, bfloat16 or float16 only");
  return y;
}

// one row of d channels -> its packed codes (d * bits / 8 bytes), zeros and steps (d / group each)
template <typename T>
void quantize_row(const T* x, int64_t d, int64_t group, int bits, uint8_t* codes, uint8_t* zeros,
                  uint8_t* steps, float* buf, uint8_t* c) {
  const float levels = static_cast<float>((1 << bits) - 1);
  const float units = static_cast<float>(1 << (8 - bits));
  for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(x[i]);
  for (int64_t g = 0; g < d / group; ++g) {
    const float* v = buf + g * group;
    float lo = v[0], hi = v[0];
    for (int64_t i = 1; i < group; ++i) {
      lo = v[i] < lo ? v[i] : lo;
      hi = v[i] > hi ? v[i] : hi;
    }
    lo = lo > 0.f ? 0.f : lo;
    hi = hi < 0.f ? 0.f : hi;
    const uint8_t u = step_byte((hi - lo) / levels);
    const float s = step_value(u);
    const float bottom = hi > -lo ? hi - levels * s : lo;
    float z = std::nearbyint(-bottom * units / s);
    z = z < 0.f ? 0.f : (z > 255.f ? 255.f : z);
    const float zu = z / units;
    for (int64_t i = 0; i < group; ++i) {
      float q = std::nearbyint(v[i] / s + zu);
      q = q < 0.f ? 0.f : (q > levels ? levels : q);
      c[g * group + i] = static_cast<uint8_t>(q);
    }
    zeros[g] = static_cast<uint8_t>(z);
    steps[g] = u;
  }
  const int per = 8 / bits;
  const int64_t w = d / per;  // byte j holds channels j, j + w, j + 2w, ... (kvevict.storage.codes.pack)
  for (int64_t j = 0; j < w; ++j) {
    uint8_t byte = 0;
    for (int k = 0; k < per; ++k) byte |= static_cast<uint8_t>(c[k * w + j] << (bits * k));
    codes[j] = byte;
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t d, int64_t group, int bits, uint8_t* out, int64_t width) {
  const int64_t cw = d * bits / 8, ng = d / group;
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(d);
    std::vector<uint8_t> c(d);
    for (int64_t r = lo; r < hi; ++r) {
      uint8_t* o = out + r * width;
      quantize_row(x + r * d, d, group, bits, o, o + cw, o + cw + ng, buf.data(), c.data());
    }
  });
}

// x (rows, d) -> one uint8 tensor (rows, d * bits / 8 + 2 * d / group): each row's packed codes, then
// its zeros, then its steps (the caller takes the three as views)
at::Tensor quantize(at::Tensor x, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize: x must be contiguous (rows, d)");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "quantize: bits must be 8, 4 or 2");
  const int64_t rows = x.size(0), d = x.size(1);
  TORCH_CHECK(d % group == 0 && d % (8 / bits) == 0, "quantize: group and packing must divide d");
  const int64_t width = d * bits / 8 + 2 * (d / group);
  at::Tensor out = at::empty({rows, width}, x.options().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  const int b = static_cast<int>(bits);
  if (x.scalar_type() == at::kFloat)
    quantize_rows(x.data_ptr<float>(), rows, d, group, b, o, width);
  else if (x.scalar_type() == at::kBFloat16)
    quantize_rows(x.data_ptr<c10::BFloat16>(), rows, d, group, b, o, width);
  else if (x.scalar_type() == at::kHalf)
    quantize_rows(x.data_ptr<c10::Half>(), rows, d, group, b, o, width);
  else
    TORCH_CHECK(false, "quantize: float32, bfloat16 or float16 only");
  return out;
}

struct Slots {  // one (b, h, n, width) store tensor: its data and strides (unit stride along width)
  uint8_t* data;
  int64_t s0, s1, s2;
  uint8_t* at(int64_t b, int64_t h, int64_t i) const { return data + b * s0 + h * s1 + i * s2; }
};

Slots slots_of(at::Tensor& t) {
  TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kByte && t.stride(3) == 1,
              "quantize_into: a store must be uint8 (b, h, n, width) with unit stride along width");
  return {t.data_ptr<uint8_t>(), t.stride(0), t.stride(1), t.stride(2)};
}

template <typename T>
void quantize_into_rows(const at::Tensor& x, const at::Tensor& idx, const bool* take, const Slots* s, int64_t group,
                        int bits) {
  const int64_t B = x.size(0), H = x.size(1), J = x.size(2), d = x.size(3);
  const T* xp = static_cast<const T*>(x.data_ptr());
  const int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(d);
    std::vector<uint8_t> c(d);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / H, h = task % H;
      for (int64_t j = 0; j < J; ++j) {
        const int64_t at_ = b * idx.stride(0) + h * idx.stride(1) + j * idx.stride(2);
        if (take && !take[(b * H + h) * J + j]) continue;
        const int64_t slot = ip[at_];
        const T* row = xp + b * x.stride(0) + h * x.stride(1) + j * x.stride(2);
        quantize_row(row, d, group, bits, s[0].at(b, h, slot), s[1].at(b, h, slot), s[2].at(b, h, slot), buf.data(),
                     c.data());
      }
    }
  });
}

// store[b, h, idx[b, h, j]] = quantize(x[b, h, j]) for k into stores 0-2 (codes, zeros, steps) and v
// into 3-5, where take (b, h, j) bool contiguous is true (empty: everywhere). The reference is
// kvevict.storage.rect.PackedStore.write's torch path: quantize_pair, then one scatter a tensor.
void quantize_into(at::Tensor k, at::Tensor v, at::Tensor idx, at::Tensor take, std::vector<at::Tensor> stores,
                   int64_t bits, int64_t group) {
  TORCH_CHECK(stores.size() == 6, "quantize_into: six stores (codes, zeros, steps of K, then of V)");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "quantize_into: bits must be 8, 4 or 2");
  TORCH_CHECK(idx.dim() == 3 && idx.scalar_type() == at::kLong, "quantize_into: idx must be int64 (b, h, j)");
  const bool* tp = take.numel() > 0 ? take.data_ptr<bool>() : nullptr;
  TORCH_CHECK(!tp || take.is_contiguous(), "quantize_into: take must be contiguous");
  Slots s[6];
  for (int i = 0; i < 6; ++i) s[i] = slots_of(stores[i]);
  const int b = static_cast<int>(bits);
  for (int part = 0; part < 2; ++part) {
    const at::Tensor& x = part == 0 ? k : v;
    TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(0) == idx.size(0) && x.size(1) == idx.size(1) &&
                    x.size(2) == idx.size(2) && x.size(3) % group == 0,
                "quantize_into: k and v must be (b, h, j, d) with unit stride along d, as idx");
    if (x.scalar_type() == at::kFloat)
      quantize_into_rows<float>(x, idx, tp, s + 3 * part, group, b);
    else if (x.scalar_type() == at::kBFloat16)
      quantize_into_rows<c10::BFloat16>(x, idx, tp, s + 3 * part, group, b);
    else if (x.scalar_type() == at::kHalf)
      quantize_into_rows<c10::Half>(x, idx, tp, s + 3 * part, group, b);
    else
      TORCH_CHECK(false, "quantize_into: float32, bfloat16 or float16 only");
  }
}

// one stored token's d channels -> x_hat = (c U - z) (s / U), rounded once to T (kvevict.storage.codes.dequantize:
// c U - z is an integer below 256 and s / U a 4-bit mantissa, both exact in T)
template <typename T>
void dequantize_row(const uint8_t* codes, const uint8_t* zeros, const uint8_t* steps, int64_t d, int64_t group, int bits,
                    T* out) {
  const int per = 8 / bits;
  const int64_t w = d / per;
  const int mask = (1 << bits) - 1;
  const float units = static_cast<float>(1 << (8 - bits));
  for (int64_t i = 0; i < d; ++i) {
    const int64_t k = i / w, j = i - k * w;
    const int code = (codes[j] >> (bits * k)) & mask;
    const int64_t g = i / group;
    const float s = static_cast<float>(static_cast<T>(step_value(steps[g]) / units));
    out[i] = static_cast<T>(static_cast<float>(code * (1 << (8 - bits)) - zeros[g]) * s);
  }
}

template <typename T>
void dequantize_from_rows(const Slots* s, const at::Tensor& idx, int64_t d, int64_t group, int bits, at::Tensor& out) {
  const int64_t B = idx.size(0), H = idx.size(1), J = idx.size(2);
  const int64_t* ip = idx.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / H, h = task % H;
      for (int64_t j = 0; j < J; ++j) {
        const int64_t slot = ip[b * idx.stride(0) + h * idx.stride(1) + j * idx.stride(2)];
        dequantize_row(s[0].at(b, h, slot), s[1].at(b, h, slot), s[2].at(b, h, slot), d, group, bits,
                       op + ((b * H + h) * J + j) * d);
      }
    }
  });
}

// the slots idx (b, h, j) of the six stores (codes, zeros, steps of K, then of V), dequantized into
// k (b, h, j, dk) and v (b, h, j, dv) of like's dtype. The reference is
// kvevict.storage.rect.PackedStore.read's torch path: a gather each, then dequantize.
std::vector<at::Tensor> dequantize_from(std::vector<at::Tensor> stores, at::Tensor idx, int64_t bits, int64_t group,
                                        at::Tensor like) {
  TORCH_CHECK(stores.size() == 6, "dequantize_from: six stores (codes, zeros, steps of K, then of V)");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "dequantize_from: bits must be 8, 4 or 2");
  TORCH_CHECK(idx.dim() == 3 && idx.scalar_type() == at::kLong, "dequantize_from: idx must be int64 (b, h, j)");
  Slots s[6];
  for (int i = 0; i < 6; ++i) s[i] = slots_of(stores[i]);
  std::vector<at::Tensor> outs;
  for (int part = 0; part < 2; ++part) {
    const int64_t d = stores[3 * part].size(3) * 8 / bits;
    TORCH_CHECK(d % group == 0, "dequantize_from: the group must divide the head size");
    at::Tensor out = at::empty({idx.size(0), idx.size(1), idx.size(2), d}, like.options());
    const int b = static_cast<int>(bits);
    if (like.scalar_type() == at::kFloat)
      dequantize_from_rows<float>(s + 3 * part, idx, d, group, b, out);
    else if (like.scalar_type() == at::kBFloat16)
      dequantize_from_rows<c10::BFloat16>(s + 3 * part, idx, d, group, b, out);
    else if (like.scalar_type() == at::kHalf)
      dequantize_from_rows<c10::Half>(s + 3 * part, idx, d, group, b, out);
    else
      TORCH_CHECK(false, "dequantize_from: float32, bfloat16 or float16 only");
    outs.push_back(out);
  }
  return outs;
}

}  // namespace kvevict_store

at::Tensor rotate(at::Tensor x, int64_t n, double scale, at::Tensor center, int64_t per) {
  return kvevict_store::rotate(x, n, scale, center, per);
}

at::Tensor quantize(at::Tensor x, int64_t bits, int64_t group) { return kvevict_store::quantize(x, bits, group); }

void quantize_into(at::Tensor k, at::Tensor v, at::Tensor idx, at::Tensor take, std::vector<at::Tensor> stores,
                   int64_t bits, int64_t group) {
  kvevict_store::quantize_into(k, v, idx, take, stores, bits, group);
}

std::vector<at::Tensor> dequantize_from(std::vector<at::Tensor> stores, at::Tensor idx, int64_t bits, int64_t group,
                                        at::Tensor like) {
  return kvevict_store::dequantize_from(stores, idx, bits, group, like);
}
