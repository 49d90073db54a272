// The tiled layout pagoda's integer kernels stream GGML weights in (quant_pack.cpp writes it
// once at load, quant_gemm.cpp reads it), shared by every kernel variant.
//
// Output rows are grouped in tiles of 16 (one 32-bit lane each of a 512-bit register, or of two
// 256-bit ones); a weight's tile count is rounded up to an even number (rows past the weight
// are zero) so that kernels may take tiles two at a time. For every block of 32 values (one
// activation block) a tile holds the 16 rows' values interleaved: 32-bit lane r of a 64-byte
// vector holds 4 consecutive values of row r, so one vpdpbusd against 4 broadcast activation
// bytes adds 4 products to each of the 16 rows' sums, with no horizontal sum.
//
// Values are stored unsigned (a format's offset, Q8_0's sign bias included, is folded into the
// integer sum through the activation block sums). Per block and tile ("group" g = values
// 4g..4g+3 of the block, byte 4r + t = value 4g + t of row r):
//   8 bits (Q8_0):  8 vectors, vector g = group g, each byte q + 128 (the int8 value, biased).
//   4 bits:         4 vectors of nibbles: vector c holds group c in its low nibbles and group
//                   c + 4 in its high nibbles (one and / shift + and per 64 bytes).
//   5 bits:         the 4 nibble vectors, then one 64-byte plane whose byte 4r + t has in bit g
//                   the 5th bit of group g's value (one shift + and + or per 64 bytes).
//   6 bits (Q6_K):  the 4 nibble vectors, then two planes: plane h, bits 2i..2i+1 of byte
//                   4r + t = bits 4-5 of group 4h + i's value.
// The scales sit apart from the values, per "scale group" (a block, or a 256-value super-block
// for the K-quants) and tile, as 16-entry rows (entry r = row r):
//   Q8_0, Q4_0, Q5_0:  d[16] fp16.
//   Q4_1, Q5_1:        d[16], m[16] fp16.
//   Q4_K, Q5_K:        d[16], dmin[16] fp16, sc[8][16], mn[8][16] (the 6-bit scales and mins).
//   Q6_K:              d[16] fp16, sc[16][16] int8.
// Memory equals the GGUF file's bytes except Q4_K / Q5_K (6-bit scales widened to bytes: +2.8%
// and +2.3%) and the padding to an even number of tiles. Tensors: values [tiles, blocks * VB],
// scales [tiles, groups * SB] (uint8).
//
// Inline layouts (Q4_0, Q4_1, Q5_0, Q5_1: one block a scale group) keep a pair's scales next to
// its values, so that a pair of tiles is one sequential stream (and a weight one stream per
// thread, pairs lying one after another): per tile pair and scale group, tile 2p's scales, tile
// 2p + 1's, then tile 2p's values of the group's blocks, then tile 2p + 1's (Q4_0: 32 + 32 + 256
// + 256 = 576 bytes, 9 cache lines, per block; Q5_0: 704, 11 lines).
// Tensors: values [tiles / 2, groups * 2 * (SB + group_blocks * VB)], scales [tiles / 2, 0].
// The K-quants keep their scales apart: inline as above, a super-block's two tiles' values lie
// 2 KB (Q4_K) apart in a 4.7 KB unit, and the one-row GEMV without software prefetch ran 2.2-2.5x
// slower (AMD EPYC Zen 4, 1 thread, CPU time, down 896 x 4864 streamed from memory).
#pragma once

#include <cstdint>

namespace pagoda_quant {

constexpr int kTileRows = 16;
constexpr int kBlock = 32;
// GGML type ids.
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

struct Layout {
  int bits;               // value width in the tile (8, 4, 5 or 6)
  int group_blocks;       // 32-value blocks per scale group (1, or 8 for the K-quants)
  int block_value_bytes;  // VB: bytes per block and tile
  int group_scale_bytes;  // SB: bytes per scale group and tile
  int gguf_group_bytes;   // one row's bytes per scale group in the GGUF file
  int offset;             // subtracted from every stored value (Q8_0: the bias of 128)
  bool affine;            // has a per-block minimum (Q4_1, Q5_1, Q4_K, Q5_K)
  bool inline_scales;     // the inline layout (see above)
};

constexpr bool known(int qtype) {
  return qtype == kQ8_0 || qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ4_K ||
         qtype == kQ5_K || qtype == kQ6_K;
}

constexpr Layout layout(int qtype) {
  switch (qtype) {
    case kQ8_0: return {8, 1, 512, 32, 34, 128, false, false};
    case kQ4_0: return {4, 1, 256, 32, 18, 8, false, true};
    case kQ4_1: return {4, 1, 256, 64, 20, 0, true, true};
    case kQ5_0: return {5, 1, 320, 32, 22, 16, false, true};
    case kQ5_1: return {5, 1, 320, 64, 24, 0, true, true};
    case kQ4_K: return {4, 8, 256, 320, 144, 0, true, false};
    case kQ5_K: return {5, 8, 320, 320, 176, 0, true, false};
    default:    return {6, 8, 384, 288, 210, 32, false, false};  // Q6_K
  }
}

inline int64_t tiles_for(int64_t rows) { return (rows + 2 * kTileRows - 1) / (2 * kTileRows) * 2; }

// Where a weight's tiles lie in its values and scales buffers (`groups` scale groups a row,
// `tiles` tiles): tile t's block j of scale group G at values + value_at(t) + G * value_group +
// j * VB, its scale group at scales + scale_at(t) + G * scale_group.
struct Placement {
  int64_t value_group, scale_group;  // bytes from one scale group to the next, within a tile
  int64_t value_tile, scale_tile;    // bytes from tile 2p to tile 2p + 1
  int64_t value_pair, scale_pair;    // bytes from pair p to pair p + 1
  int64_t value_head;                // bytes before a pair's first values
  int64_t value_at(int64_t tile) const { return tile / 2 * value_pair + value_head + tile % 2 * value_tile; }
  int64_t scale_at(int64_t tile) const { return tile / 2 * scale_pair + tile % 2 * scale_tile; }
  // The tensors' shapes for `tiles` tiles: {values rows, values cols, scales rows, scales cols}.
  int64_t shape[4];
};

inline Placement placement(const Layout& lay, int64_t groups, int64_t tiles) {
  const int64_t vg = lay.group_blocks * lay.block_value_bytes, sg = lay.group_scale_bytes;
  if (lay.inline_scales) {
    const int64_t unit = 2 * (sg + vg);  // one scale group of a pair
    return {unit, unit, vg, sg, groups * unit, groups * unit, 2 * sg, {tiles / 2, groups * unit, tiles / 2, 0}};
  }
  return {vg, sg, groups * vg, groups * sg, 2 * groups * vg, 2 * groups * sg, 0, {tiles, groups * vg, tiles, groups * sg}};
}

}  // namespace pagoda_quant
