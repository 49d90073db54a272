// GGUF rows <-> the integer kernels' tiled layout (quant_layout.h), losslessly both ways: the
// kernels read the tiles, and dequantizing (tests, the embedding rows of a tied head) goes back
// to the file's bytes and the reference dequantizer.
//
// A gate/up weight packed with `swiglu` ([gate; up], 2 * I rows) pairs its tiles: tile 2p holds
// gate rows 16p..16p+15 and tile 2p + 1 the matching up rows, so that a kernel computing a pair
// writes silu(gate) * up for 16 outputs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "quant_layout.h"
#include "vec.h"

#include <cstring>

namespace {

using namespace pagoda_quant;

// One row's scale group (a block, or a K-quant super-block) decoded: stored values (unsigned,
// as the tile keeps them) and scale fields.
struct Group {
  uint8_t q[256];
  uint16_t d = 0, m = 0;  // fp16 bits: d and m (Q4_1 / Q5_1) or dmin (Q4_K / Q5_K)
  uint8_t sc[16] = {};    // 6-bit scales (K4 / K5: 8) or int8 scales (Q6_K: 16)
  uint8_t mn[8] = {};     // 6-bit mins (K4 / K5)
};

uint16_t get16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
void put16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

void nibbles_in(const uint8_t* qs, uint8_t* q) {  // 16 bytes: values j (low) and 16 + j (high)
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 0x0F;
    q[16 + j] = qs[j] >> 4;
  }
}
void nibbles_out(const uint8_t* q, uint8_t* qs) {
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>((q[j] & 0x0F) | (q[16 + j] << 4));
}

// Q4_K / Q5_K's 12 scale bytes <-> eight 6-bit (scale, min) pairs.
void k_scales_in(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = static_cast<uint8_t>((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
    mn[j + 4] = static_cast<uint8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}
void k_scales_out(const uint8_t* sc, const uint8_t* mn, uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4));
  }
}

// Q4_K / Q5_K's 128 nibble bytes: chunk c of 32 bytes holds sub-block 2c (low) and 2c + 1 (high).
void k_nibbles_in(const uint8_t* qs, uint8_t* q) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      q[64 * c + l] = qs[32 * c + l] & 0x0F;
      q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
}
void k_nibbles_out(const uint8_t* q, uint8_t* qs) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) qs[32 * c + l] = static_cast<uint8_t>((q[64 * c + l] & 0x0F) | (q[64 * c + 32 + l] << 4));
}

void decode(int qtype, const uint8_t* src, Group& g) {
  switch (qtype) {
    case kQ8_0:
      g.d = get16(src);
      for (int j = 0; j < 32; ++j) g.q[j] = static_cast<uint8_t>(src[2 + j] ^ 0x80);  // int8 + 128
      break;
    case kQ4_0:
      g.d = get16(src);
      nibbles_in(src + 2, g.q);
      break;
    case kQ4_1:
      g.d = get16(src);
      g.m = get16(src + 2);
      nibbles_in(src + 4, g.q);
      break;
    case kQ5_0:
    case kQ5_1: {
      const int head = qtype == kQ5_0 ? 2 : 4;
      g.d = get16(src);
      if (qtype == kQ5_1) g.m = get16(src + 2);
      uint32_t qh;
      std::memcpy(&qh, src + head, 4);
      nibbles_in(src + head + 4, g.q);
      for (int j = 0; j < 32; ++j) g.q[j] |= static_cast<uint8_t>(((qh >> j) & 1) << 4);
      break;
    }
    case kQ4_K:
    case kQ5_K:
      g.d = get16(src);
      g.m = get16(src + 2);
      k_scales_in(src + 4, g.sc, g.mn);
      if (qtype == kQ4_K) {
        k_nibbles_in(src + 16, g.q);
      } else {  // qh byte l, bit j: the 5th bit of value l of sub-block j
        k_nibbles_in(src + 48, g.q);
        for (int j = 0; j < 8; ++j)
          for (int l = 0; l < 32; ++l) g.q[32 * j + l] |= static_cast<uint8_t>(((src[16 + l] >> j) & 1) << 4);
      }
      break;
    default: {  // Q6_K: ql[128], qh[64], scales[16], d; halves of 128 values, runs of 32
      for (int h = 0; h < 2; ++h)
        for (int run = 0; run < 4; ++run)
          for (int l = 0; l < 32; ++l) {
            const uint8_t low = src[64 * h + 32 * (run & 1) + l];
            const int lo = run < 2 ? (low & 0x0F) : (low >> 4);
            const int hi = (src[128 + 32 * h + l] >> (2 * run)) & 3;
            g.q[128 * h + 32 * run + l] = static_cast<uint8_t>(lo | (hi << 4));
          }
      std::memcpy(g.sc, src + 192, 16);
      g.d = get16(src + 208);
    }
  }
}

void encode(int qtype, const Group& g, uint8_t* dst) {
  switch (qtype) {
    case kQ8_0:
      put16(dst, g.d);
      for (int j = 0; j < 32; ++j) dst[2 + j] = static_cast<uint8_t>(g.q[j] ^ 0x80);
      break;
    case kQ4_0:
      put16(dst, g.d);
      nibbles_out(g.q, dst + 2);
      break;
    case kQ4_1:
      put16(dst, g.d);
      put16(dst + 2, g.m);
      nibbles_out(g.q, dst + 4);
      break;
    case kQ5_0:
    case kQ5_1: {
      const int head = qtype == kQ5_0 ? 2 : 4;
      put16(dst, g.d);
      if (qtype == kQ5_1) put16(dst + 2, g.m);
      uint32_t qh = 0;
      for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>((g.q[j] >> 4) & 1) << j;
      std::memcpy(dst + head, &qh, 4);
      nibbles_out(g.q, dst + head + 4);
      break;
    }
    case kQ4_K:
    case kQ5_K:
      put16(dst, g.d);
      put16(dst + 2, g.m);
      k_scales_out(g.sc, g.mn, dst + 4);
      if (qtype == kQ4_K) {
        k_nibbles_out(g.q, dst + 16);
      } else {
        k_nibbles_out(g.q, dst + 48);
        for (int l = 0; l < 32; ++l) {
          uint8_t bits = 0;
          for (int j = 0; j < 8; ++j) bits |= static_cast<uint8_t>(((g.q[32 * j + l] >> 4) & 1) << j);
          dst[16 + l] = bits;
        }
      }
      break;
    default:
      std::memset(dst, 0, 192);
      for (int h = 0; h < 2; ++h)
        for (int run = 0; run < 4; ++run)
          for (int l = 0; l < 32; ++l) {
            const int q = g.q[128 * h + 32 * run + l];
            dst[64 * h + 32 * (run & 1) + l] |= static_cast<uint8_t>(run < 2 ? (q & 0x0F) : (q & 0x0F) << 4);
            dst[128 + 32 * h + l] |= static_cast<uint8_t>((q >> 4) << (2 * run));
          }
      std::memcpy(dst + 192, g.sc, 16);
      put16(dst + 208, g.d);
  }
}

// The 32 values of one block of row lane `r` in a tile block (see quant_layout.h).
void put_values(int bits, int r, const uint8_t* q, uint8_t* block) {
  for (int g = 0; g < 8; ++g)
    for (int t = 0; t < 4; ++t) {
      const int value = q[4 * g + t], byte = 4 * r + t;
      if (bits == 8) {
        block[64 * g + byte] = static_cast<uint8_t>(value);
        continue;
      }
      block[64 * (g & 3) + byte] |= static_cast<uint8_t>(g < 4 ? (value & 0x0F) : (value & 0x0F) << 4);
      if (bits == 5) block[256 + byte] |= static_cast<uint8_t>(((value >> 4) & 1) << g);
      if (bits == 6) block[256 + 64 * (g / 4) + byte] |= static_cast<uint8_t>(((value >> 4) & 3) << (2 * (g % 4)));
    }
}
void get_values(int bits, int r, const uint8_t* block, uint8_t* q) {
  for (int g = 0; g < 8; ++g)
    for (int t = 0; t < 4; ++t) {
      const int byte = 4 * r + t;
      int value;
      if (bits == 8) {
        value = block[64 * g + byte];
      } else {
        const int nib = block[64 * (g & 3) + byte];
        value = g < 4 ? (nib & 0x0F) : (nib >> 4);
        if (bits == 5) value |= ((block[256 + byte] >> g) & 1) << 4;
        if (bits == 6) value |= ((block[256 + 64 * (g / 4) + byte] >> (2 * (g % 4))) & 3) << 4;
      }
      q[4 * g + t] = static_cast<uint8_t>(value);
    }
}

// A row's scale fields <-> its entries in a tile's scale group (see quant_layout.h).
void put_scales(int qtype, int r, const Group& g, uint8_t* s) {
  put16(s + 2 * r, g.d);
  if (qtype == kQ4_1 || qtype == kQ5_1) put16(s + 32 + 2 * r, g.m);
  if (qtype == kQ4_K || qtype == kQ5_K) {
    put16(s + 32 + 2 * r, g.m);
    for (int j = 0; j < 8; ++j) {
      s[64 + 16 * j + r] = g.sc[j];
      s[192 + 16 * j + r] = g.mn[j];
    }
  }
  if (qtype == kQ6_K)
    for (int j = 0; j < 16; ++j) s[32 + 16 * j + r] = g.sc[j];
}
void get_scales(int qtype, int r, const uint8_t* s, Group& g) {
  g.d = get16(s + 2 * r);
  if (qtype == kQ4_1 || qtype == kQ5_1) g.m = get16(s + 32 + 2 * r);
  if (qtype == kQ4_K || qtype == kQ5_K) {
    g.m = get16(s + 32 + 2 * r);
    for (int j = 0; j < 8; ++j) {
      g.sc[j] = s[64 + 16 * j + r];
      g.mn[j] = s[192 + 16 * j + r];
    }
  }
  if (qtype == kQ6_K)
    for (int j = 0; j < 16; ++j) g.sc[j] = s[32 + 16 * j + r];
}

struct Geometry {
  Layout lay;
  int64_t blocks, groups, tiles;
  Placement at;
};

Geometry geometry(int64_t qtype, int64_t K, int64_t rows, bool swiglu) {
  TORCH_CHECK(known(static_cast<int>(qtype)), "quant: no integer kernel for GGML type ", qtype);
  const Layout lay = layout(static_cast<int>(qtype));
  const int64_t group_values = kBlock * lay.group_blocks;
  TORCH_CHECK(K > 0 && K % group_values == 0, "quant: rows of this type need a multiple of ", group_values,
              " values, got ", K);
  TORCH_CHECK(!swiglu || rows % 2 == 0, "quant: a gate/up weight needs an even number of rows, got ", rows);
  const int64_t blocks = K / kBlock, groups = K / group_values;
  const int64_t tiles = swiglu ? 2 * ((rows / 2 + kTileRows - 1) / kTileRows) : tiles_for(rows);
  return {lay, blocks, groups, tiles, placement(lay, groups, tiles)};
}

// Logical row n of a weight of `rows` rows -> its (tile, lane).
inline std::pair<int64_t, int> slot(int64_t n, int64_t rows, bool swiglu) {
  if (!swiglu) return {n / kTileRows, static_cast<int>(n % kTileRows)};
  const int64_t half = rows / 2, col = n < half ? n : n - half;
  return {2 * (col / kTileRows) + (n < half ? 0 : 1), static_cast<int>(col % kTileRows)};
}

std::tuple<at::Tensor, at::Tensor> quant_pack(const at::Tensor& raw, int64_t qtype, int64_t K, bool swiglu) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.device().is_cpu(),
              "quant_pack: raw must be 2-D uint8 CPU rows");
  const at::Tensor src_t = raw.contiguous();
  const int64_t N = src_t.size(0);
  const Geometry geo = geometry(qtype, K, N, swiglu);
  TORCH_CHECK(src_t.size(1) == geo.groups * geo.lay.gguf_group_bytes, "quant_pack: ", src_t.size(1),
              " bytes per row do not match ", K, " values of GGML type ", qtype);
  const int64_t* shape = geo.at.shape;
  at::Tensor values = at::zeros({shape[0], shape[1]}, raw.options());
  at::Tensor scales = at::zeros({shape[2], shape[3]}, raw.options());
  const uint8_t* src = src_t.data_ptr<uint8_t>();
  uint8_t* dv = values.data_ptr<uint8_t>();
  uint8_t* ds = geo.lay.inline_scales ? dv : scales.data_ptr<uint8_t>();
  const int qt = static_cast<int>(qtype);
  // Rows write disjoint bytes (lane r owns bytes 4r..4r+3 of every vector, and its scale entries).
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    Group g;
    for (int64_t n = n0; n < n1; ++n) {
      const auto [tile, r] = slot(n, N, swiglu);
      for (int64_t G = 0; G < geo.groups; ++G) {
        decode(qt, src + n * src_t.size(1) + G * geo.lay.gguf_group_bytes, g);
        put_scales(qt, r, g, ds + geo.at.scale_at(tile) + G * geo.at.scale_group);
        for (int j = 0; j < geo.lay.group_blocks; ++j)
          put_values(geo.lay.bits, r, g.q + kBlock * j,
                     dv + geo.at.value_at(tile) + G * geo.at.value_group + j * geo.lay.block_value_bytes);
      }
    }
  });
  return {values, scales};
}

// Rows `index` (logical, of a weight of `rows` rows) back as the GGUF file stores them.
at::Tensor quant_unpack(const at::Tensor& values, const at::Tensor& scales, int64_t qtype, int64_t K, int64_t rows,
                        bool swiglu, const at::Tensor& index) {
  const Geometry geo = geometry(qtype, K, rows, swiglu);
  const int64_t* shape = geo.at.shape;
  TORCH_CHECK(values.scalar_type() == at::kByte && values.is_contiguous() && values.dim() == 2 &&
                  values.size(0) == shape[0] && values.size(1) == shape[1],
              "quant_unpack: values do not match the layout");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == shape[2] && scales.size(1) == shape[3],
              "quant_unpack: scales do not match the layout");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "quant_unpack: index must be 1-D int64");
  const at::Tensor idx = index.contiguous();
  const int64_t count = idx.size(0), row_bytes = geo.groups * geo.lay.gguf_group_bytes;
  at::Tensor out = at::empty({count, row_bytes}, values.options());
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "quant_unpack: row ", ip[i], " out of range for ", rows, " rows");
  const uint8_t* sv = values.data_ptr<uint8_t>();
  const uint8_t* ss = geo.lay.inline_scales ? sv : scales.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int qt = static_cast<int>(qtype);
  at::parallel_for(0, count, 16, [&](int64_t i0, int64_t i1) {
    Group g;
    for (int64_t i = i0; i < i1; ++i) {
      const auto [tile, r] = slot(ip[i], rows, swiglu);
      for (int64_t G = 0; G < geo.groups; ++G) {
        get_scales(qt, r, ss + geo.at.scale_at(tile) + G * geo.at.scale_group, g);
        for (int j = 0; j < geo.lay.group_blocks; ++j)
          get_values(geo.lay.bits, r, sv + geo.at.value_at(tile) + G * geo.at.value_group + j * geo.lay.block_value_bytes,
                     g.q + kBlock * j);
        encode(qt, g, dst + i * row_bytes + G * geo.lay.gguf_group_bytes);
      }
    }
  });
  return out;
}

// fp16 bits -> fp32 as the reference dequantizer converts them (numpy's rule: a NaN keeps its
// payload, not quieted as F16C's conversion would).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Whether `quant_dequant_rows` dequantizes this type: those whose reference is one product
// d * (q - offset) per value (Q8_0, Q4_0, Q5_0), so that the float32 results are its bits.
bool dequant_native(int qtype) { return qtype == kQ8_0 || qtype == kQ4_0 || qtype == kQ5_0; }

// Rows `index` (logical) as float32 [count, K], straight from the tiles (an embedding's few
// rows a step), equal bit for bit to the reference dequantizer of the file's bytes.
at::Tensor quant_dequant_rows(const at::Tensor& values, const at::Tensor& scales, int64_t qtype, int64_t K,
                              int64_t rows, bool swiglu, const at::Tensor& index) {
  TORCH_CHECK(dequant_native(static_cast<int>(qtype)), "quant_dequant_rows: GGML type ", qtype,
              " is not one of Q8_0, Q4_0, Q5_0");
  const Geometry geo = geometry(qtype, K, rows, swiglu);
  const int64_t* shape = geo.at.shape;
  TORCH_CHECK(values.scalar_type() == at::kByte && values.is_contiguous() && values.dim() == 2 &&
                  values.size(0) == shape[0] && values.size(1) == shape[1] && scales.scalar_type() == at::kByte &&
                  scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == shape[2] &&
                  scales.size(1) == shape[3],
              "quant_dequant_rows: values and scales do not match the layout");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "quant_dequant_rows: index must be 1-D int64");
  const at::Tensor idx = index.contiguous();
  const int64_t count = idx.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "quant_dequant_rows: row ", ip[i], " out of range for ", rows, " rows");
  at::Tensor out = at::empty({count, K}, values.options().dtype(at::kFloat));
  const uint8_t* sv = values.data_ptr<uint8_t>();
  const uint8_t* ss = geo.lay.inline_scales ? sv : scales.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const int qt = static_cast<int>(qtype);
  const int offset = geo.lay.offset;  // Q8_0: the stored q + 128
  for (int64_t i = 0; i < count; ++i) {
    const auto [tile, r] = slot(ip[i], rows, swiglu);
    Group g;
    for (int64_t G = 0; G < geo.groups; ++G) {
      get_scales(qt, r, ss + geo.at.scale_at(tile) + G * geo.at.scale_group, g);
      get_values(geo.lay.bits, r, sv + geo.at.value_at(tile) + G * geo.at.value_group, g.q);
      const float d = half_to_float(g.d);
      float* o = dst + i * K + G * kBlock;
      for (int j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(static_cast<int>(g.q[j]) - offset);
    }
  }
  return out;
}

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.def(
      "quant_dequant_rows(Tensor values, Tensor scales, int qtype, int k, int rows, bool swiglu, Tensor index) -> "
      "Tensor");
  m.impl("quant_dequant_rows", c10::DispatchKey::CPU, TORCH_FN(quant_dequant_rows));
  m.def("quant_pack(Tensor raw, int qtype, int k, bool swiglu) -> (Tensor, Tensor)");
  m.def("quant_unpack(Tensor values, Tensor scales, int qtype, int k, int rows, bool swiglu, Tensor index) -> Tensor");
  m.impl("quant_pack", c10::DispatchKey::CPU, TORCH_FN(quant_pack));
  m.impl("quant_unpack", c10::DispatchKey::CPU, TORCH_FN(quant_unpack));
}
