//! f32 runs converted to bf16 pairs (two to a `u32`, rounded as the hardware rounds), and the
//! masked loads and stores of 16 lanes that the packing and the microkernel share.

use std::arch::x86_64::*;

/// The index that interleaves the two halves of a 32-lane bf16 vector: lanes 0, 16, 1, 17, ...
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn interleave_index() -> __m512i {
    let idx: [u16; 32] = std::array::from_fn(|j| ((j % 2) * 16 + j / 2) as u16);
    // SAFETY: reads 64 bytes from a 64-byte array.
    unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
}

/// The 16 floats at `p` under `mask` (zeros elsewhere), by a plain load when all 16 are
/// wanted: on this Zen 5 a masked load or store of memory not in cache ran at a third of a
/// plain one's rate (a conversion pass: 11.6 against 38.6 GB/s), so the masks are for the
/// ends of runs only.
///
/// # Safety
/// The masked elements of `p` must be readable.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn load16(p: *const f32, mask: u16) -> __m512 {
    // SAFETY: the caller vouches for the masked elements; all 16 when the mask is full.
    unsafe {
        if mask == u16::MAX {
            _mm512_loadu_ps(p)
        } else {
            _mm512_maskz_loadu_ps(mask, p)
        }
    }
}

/// Stores the 32-bit lanes of `v` under `mask` at `p`, plainly when all 16 are (see
/// [`load16`]).
///
/// # Safety
/// The masked lanes of `p` must be writable.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn store16(p: *mut f32, mask: u16, v: __m512) {
    // SAFETY: the caller vouches for the masked lanes; all 16 when the mask is full.
    unsafe {
        if mask == u16::MAX {
            _mm512_storeu_ps(p, v)
        } else {
            _mm512_mask_storeu_ps(p, mask, v)
        }
    }
}

/// `out[j] = pair(lo[j], hi[j])` for the `lo.len()` (== `hi.len()` == `out.len()`) elements.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) fn interleave(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    let n = out.len();
    assert!(lo.len() == n && hi.len() == n);
    let idx = interleave_index();
    let mut j = 0;
    while j < n {
        let w = (n - j).min(16);
        let mask = mask16(w);
        // SAFETY: the masked loads and store touch elements j..j + w, inside every slice.
        unsafe {
            let l = load16(lo.as_ptr().add(j), mask);
            let h = load16(hi.as_ptr().add(j), mask);
            // Lanes 0..16: lo's bf16; 16..32: hi's. Interleaved: 16 (lo, hi) pairs.
            let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
            let pairs = _mm512_permutexvar_epi16(idx, both);
            store16(
                out.as_mut_ptr().add(j).cast(),
                mask,
                _mm512_castsi512_ps(pairs),
            );
        }
        j += w;
    }
}

/// A row of `k` f32 as `⌈k/2⌉` pairs: its bf16 values in order.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) fn convert_row(row: &[f32], out: &mut [u32]) {
    let k = row.len();
    let mut j = 0;
    while j < k {
        let w = (k - j).min(32);
        // SAFETY: the masked loads touch row[j..j + w]; the store touches out's pairs
        // j/2..(j + w).div_ceil(2), which exist since out has ⌈k/2⌉.
        unsafe {
            let l = load16(row.as_ptr().add(j), mask16(w.min(16)));
            let h = load16(
                row.as_ptr().wrapping_add(j + 16),
                mask16(w.saturating_sub(16)),
            );
            let both: __m512 = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
            store16(
                out.as_mut_ptr().add(j / 2).cast(),
                mask16(w.div_ceil(2)),
                both,
            );
        }
        j += w;
    }
}

/// An f32 scratch buffer seen as pairs.
pub(super) fn as_u32(floats: &[f32]) -> &[u32] {
    bytemuck::cast_slice(floats)
}

pub(super) fn as_u32_mut(floats: &mut [f32]) -> &mut [u32] {
    bytemuck::cast_slice_mut(floats)
}

pub(super) fn mask16(w: usize) -> u16 {
    if w >= 16 {
        u16::MAX
    } else {
        ((1u32 << w) - 1) as u16
    }
}
