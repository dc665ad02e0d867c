//! The matrix multiply under the convolutions: strided matrix views checked against their
//! slices, multiplied in f32 by the `gemm` crate or, in [`Precision::Bf16`], with bf16 inputs
//! by our own AVX512_BF16 kernel (module `bf16`).
//!
//! Every gemm call runs on the calling thread (`Parallelism::None`). [`par_matmul`] shares one
//! product out to rayon's threads itself, by tiles of the destination whose bounds depend only
//! on the shapes: each destination element is computed whole, by one thread, in the same order
//! whatever the thread count, so the result is bit-identical with 1 thread or 64.

#[cfg(target_arch = "x86_64")]
pub mod bf16;
mod par;
pub use par::{Tiling, par_matmul, par_matmul_packed, par_matmul_uninit};

/// What a GEMM's inputs are rounded to before they are multiplied; the sums are f32 either way:
/// `F32` by the `gemm` crate, `Bf16` by AVX512_BF16's `vdpbf16ps`, as PyTorch's CPU autocast
/// does. The setting's own enum (`--precision`), shared with the crates that name it.
pub use contract::choices::Precision;

/// Whether this machine computes in `precision`: bf16 needs AVX512_BF16.
pub fn available(precision: Precision) -> bool {
    match precision {
        Precision::F32 => true,
        #[cfg(target_arch = "x86_64")]
        Precision::Bf16 => bf16::available(),
        #[cfg(not(target_arch = "x86_64"))]
        Precision::Bf16 => false,
    }
}

/// A read-only matrix view: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a> Mat<'a> {
    /// A row-major matrix (`rows × cols`, rows contiguous).
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Mat {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// Rows `range` of this view (no copy).
    pub(crate) fn row_range(self, range: std::ops::Range<usize>) -> Self {
        assert!(
            range.start <= range.end && range.end <= self.rows,
            "row range {range:?} of {}",
            self.rows
        );
        Mat {
            data: if range.is_empty() || self.cols == 0 {
                &self.data[..0]
            } else {
                &self.data[range.start * self.row_stride..]
            },
            rows: range.len(),
            ..self
        }
    }

    /// Columns `range` of this view (no copy).
    pub(crate) fn col_range(self, range: std::ops::Range<usize>) -> Self {
        self.t().row_range(range).t()
    }

    /// The transpose of this view (no copy).
    pub fn t(self) -> Self {
        Mat {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    fn check(&self, what: &str) {
        assert!(
            fits(
                self.data.len(),
                self.rows,
                self.cols,
                self.row_stride,
                self.col_stride
            ),
            "{what}: a {}×{} view with strides ({}, {}) overruns its {} elements",
            self.rows,
            self.cols,
            self.row_stride,
            self.col_stride,
            self.data.len()
        );
    }
}

fn fits(len: usize, rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * row_stride + (cols - 1) * col_stride < len
}

/// A right-hand side packed once for the many products that share it (a layer's weight through
/// a forward or a backward): bf16 panels for [`Precision::Bf16`]; nothing for f32, which the
/// `gemm` crate packs per product.
pub(crate) struct PackedRhs {
    #[cfg(target_arch = "x86_64")]
    bf16: Option<bf16::PackedB>,
    rows: usize,
}

impl PackedRhs {
    pub(crate) fn new(rhs: Mat, precision: Precision) -> Self {
        rhs.check("packed rhs");
        #[cfg(not(target_arch = "x86_64"))]
        let _ = precision;
        PackedRhs {
            #[cfg(target_arch = "x86_64")]
            bf16: (precision == Precision::Bf16).then(|| bf16::PackedB::new(rhs)),
            rows: rhs.rows,
        }
    }

    /// Rows `rows` and columns `cols` of it, for [`par_matmul_packed`]: `None` for f32, or when
    /// the block does not start on a pair of rows and a panel of columns (the product then
    /// packs its own).
    pub(crate) fn view(
        &self,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Option<RhsPanels<'_>> {
        #[cfg(target_arch = "x86_64")]
        {
            let b = self.bf16.as_ref()?.view();
            Some(RhsPanels(b.rows(rows, self.rows)?.cols(cols)?))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (rows, cols, self.rows);
            None
        }
    }
}

/// A block of a [`PackedRhs`].
#[derive(Clone, Copy)]
pub struct RhsPanels<'a>(
    #[cfg(target_arch = "x86_64")] bf16::PanelView<'a>,
    #[cfg(not(target_arch = "x86_64"))] std::marker::PhantomData<&'a ()>,
);

impl RhsPanels<'_> {
    fn cols(self, cols: std::ops::Range<usize>) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        return self.0.cols(cols).map(RhsPanels);
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = cols;
            None
        }
    }

    fn fits(&self, k: usize, n: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self.0.fits(k, n);
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (k, n);
            false
        }
    }
}

/// `dst = lhs · rhs`, or `dst += lhs · rhs` when `accumulate`; `dst` is row-major with
/// `dst_stride` between rows; the inputs rounded to `precision`. On the calling thread.
///
/// Panics when `precision` is not [`available`](Precision::available) here.
pub fn matmul(
    dst: &mut [f32],
    dst_stride: usize,
    lhs: Mat,
    rhs: Mat,
    accumulate: bool,
    precision: Precision,
) {
    matmul_packed(dst, dst_stride, lhs, rhs, None, accumulate, precision)
}

/// [`matmul`] with `rhs` already packed (`panels`, a view of a [`PackedRhs`] of exactly `rhs`)
/// when there is a packing.
pub(crate) fn matmul_packed(
    dst: &mut [f32],
    dst_stride: usize,
    lhs: Mat,
    rhs: Mat,
    panels: Option<RhsPanels>,
    accumulate: bool,
    precision: Precision,
) {
    check_product(dst.len(), dst_stride, &lhs, &rhs, panels, precision);
    // SAFETY: `check_product` proved every view lies inside its slice, and `dst` is borrowed
    // mutably while the inputs are shared borrows, so they cannot overlap.
    unsafe {
        gemm_unchecked(
            dst.as_mut_ptr(),
            dst_stride,
            lhs,
            rhs,
            (panels, None),
            accumulate,
            precision,
        )
    }
}

/// [`matmul`] (`dst = lhs · rhs`) into memory not yet initialised, on the calling thread: it
/// writes every element of the `lhs.rows × rhs.cols` block at `dst` and reads none (as
/// [`par_matmul_uninit`]).
pub(crate) fn matmul_uninit(
    dst: &mut [std::mem::MaybeUninit<f32>],
    dst_stride: usize,
    lhs: Mat,
    rhs: Mat,
    precision: Precision,
) {
    check_product(dst.len(), dst_stride, &lhs, &rhs, None, precision);
    // SAFETY: as in `par_matmul_uninit`: checked above, and without `accumulate` the product
    // writes the block and never reads it.
    unsafe {
        gemm_unchecked(
            dst.as_mut_ptr().cast::<f32>(),
            dst_stride,
            lhs,
            rhs,
            (None, None),
            false,
            precision,
        )
    }
}

/// A bf16 left-hand side in pairs, packed once for the bands of columns of one product.
#[cfg(target_arch = "x86_64")]
type PackedLhs = bf16::PackedA;
#[cfg(not(target_arch = "x86_64"))]
type PackedLhs = ();

/// Panics unless the views lie inside their slices, an `m × n` destination with `dst_stride`
/// fits in `dst_len` elements, and this machine computes in `precision`.
fn check_product(
    dst_len: usize,
    dst_stride: usize,
    lhs: &Mat,
    rhs: &Mat,
    panels: Option<RhsPanels>,
    precision: Precision,
) {
    assert!(
        available(precision),
        "matmul: this CPU has no {} arithmetic (the command line refuses it first)",
        precision.name()
    );
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    assert_eq!(rhs.rows, k, "matmul: inner dimensions differ");
    if let Some(panels) = panels {
        assert!(
            precision == Precision::Bf16 && panels.fits(k, n),
            "matmul: packed panels of another shape or precision than a {k}×{n} {} rhs",
            precision.name()
        );
    }
    lhs.check("matmul lhs");
    rhs.check("matmul rhs");
    assert!(
        fits(dst_len, m, n, dst_stride, 1),
        "matmul: a {m}×{n} destination with row stride {dst_stride} overruns its {dst_len} elements"
    );
}

/// The `gemm` crate's threshold for copying a left operand already laid out in columns into
/// its own panels: it copies when a block of the product is wider than this many of its
/// microkernel's columns (6 on AVX-512). Its default, 8, copied whole activations (im2col's
/// weight gradients read the patch matrix, in columns, as their left operand) once per
/// product, for reads the microkernel makes as well in place; at 256, the crate's largest, such
/// an operand is read in place but in the widest products. Copying or not moves no arithmetic.
pub(crate) const GEMM_LHS_PACKING_THRESHOLD: usize = 256;

/// Sets the `gemm` crate's options this module's products are tuned for, once per process.
fn configure_gemm() {
    static CONFIGURED: std::sync::Once = std::sync::Once::new();
    CONFIGURED.call_once(|| {
        // Every product here runs on one thread (`Parallelism::None`): the single-thread one.
        gemm::set_lhs_packing_threshold_single_thread(GEMM_LHS_PACKING_THRESHOLD);
    });
}

/// # Safety
/// `lhs` and `rhs` lie inside their slices, the `lhs.rows × rhs.cols` elements at `dst` (row
/// stride `dst_stride`) are valid for writes (and initialised, when `accumulate`), read or
/// written by no one else meanwhile, `precision` is available, and `packed_lhs` (if any) packs
/// `lhs`.
unsafe fn gemm_unchecked(
    dst: *mut f32,
    dst_stride: usize,
    lhs: Mat,
    rhs: Mat,
    (panels, packed_lhs): (Option<RhsPanels>, Option<&PackedLhs>),
    accumulate: bool,
    precision: Precision,
) {
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: row `i` of the destination, valid for writes per the contract (and
                // written without being read: it may be uninitialised, see `par_matmul_uninit`).
                unsafe { std::ptr::write_bytes(dst.add(i * dst_stride), 0, n) };
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if precision == Precision::Bf16 {
        // SAFETY: per the contract (bf16 available, views inside, k > 0).
        return unsafe {
            bf16::gemm(
                dst,
                dst_stride,
                lhs,
                rhs,
                panels.map(|p| p.0),
                packed_lhs,
                accumulate,
            )
        };
    }
    debug_assert_eq!(precision, Precision::F32);
    let _ = (panels, packed_lhs);
    configure_gemm();
    // SAFETY: per the contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_stride as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(lhs: Mat, rhs: Mat) -> Vec<f32> {
        let mut out = vec![0.0; lhs.rows * rhs.cols];
        for i in 0..lhs.rows {
            for j in 0..rhs.cols {
                let mut s = 0.0f64;
                for p in 0..lhs.cols {
                    s += lhs.data[i * lhs.row_stride + p * lhs.col_stride] as f64
                        * rhs.data[p * rhs.row_stride + j * rhs.col_stride] as f64;
                }
                out[i * rhs.cols + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn the_first_f32_product_sets_gemms_packing_threshold() {
        // A column-major lhs wider than the crate's default threshold would copy (8 × 6
        // columns): the product is right, and from now on such an operand is read in place.
        let (m, n, k) = (64, 96, 33);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 - 5.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.25).collect();
        let (lhs, rhs) = (Mat::rows(&a, k, m).t(), Mat::rows(&b, k, n));
        let mut dst = vec![0.0; m * n];
        matmul(&mut dst, n, lhs, rhs, false, Precision::F32);
        assert_eq!(dst, naive(lhs, rhs));
        assert_eq!(
            gemm::get_lhs_packing_threshold_single_thread(),
            GEMM_LHS_PACKING_THRESHOLD
        );
    }

    #[test]
    fn transposed_views_and_accumulation_match_a_naive_product() {
        let a: Vec<f32> = (0..35).map(|i| (i % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..20).map(|i| (i % 5) as f32 * 0.5).collect();
        // a is 5×7 stored row-major; use its transpose (7×5) times b (5×4).
        let lhs = Mat::rows(&a, 5, 7).t();
        let rhs = Mat::rows(&b, 5, 4);
        let mut dst = vec![1.0; 28];
        matmul(&mut dst, 4, lhs, rhs, false, Precision::F32);
        assert_eq!(dst, naive(lhs, rhs));
        matmul(&mut dst, 4, lhs, rhs, true, Precision::F32);
        let twice: Vec<f32> = naive(lhs, rhs).iter().map(|v| 2.0 * v).collect();
        assert_eq!(dst, twice);
    }

    #[test]
    fn tiled_products_match_a_naive_product_and_any_thread_count() {
        // Split by rows, by columns, and not at all; transposed views and accumulation.
        for (m, n, k, transposed) in [
            (700, 40, 300, false),
            (30, 900, 200, true),
            (50, 60, 70, false),
        ] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919) % 23) as f32 / 11.0 - 1.0)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 104729) % 19) as f32 / 9.0 - 1.0)
                .collect();
            let lhs = if transposed {
                Mat::rows(&a, k, m).t()
            } else {
                Mat::rows(&a, m, k)
            };
            let rhs = Mat::rows(&b, k, n);
            let want = naive(lhs, rhs);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut dst = vec![0.5; m * (n + 3)];
                pool.install(|| par_matmul(&mut dst, n + 3, lhs, rhs, true, Precision::F32));
                dst
            };
            let one = run(1);
            for (i, row) in one.chunks(n + 3).enumerate() {
                for (j, v) in row.iter().enumerate() {
                    let expected = if j < n {
                        0.5 + want[i * n + j] as f64
                    } else {
                        0.5
                    };
                    assert!(
                        (*v as f64 - expected).abs() < 1e-3,
                        "({i}, {j}) of {m}×{n}×{k}: {v} vs {expected}"
                    );
                }
            }
            for threads in [2, 3, 5] {
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&run(threads)) == bits(&one),
                    "{m}×{n}×{k} differs at {threads} threads"
                );
            }
        }
        assert!(Tiling::of(700, 40, 300).tiles > 1 && Tiling::of(700, 40, 300).by_rows);
        assert!(Tiling::of(30, 900, 200).tiles > 1 && !Tiling::of(30, 900, 200).by_rows);
        assert_eq!(Tiling::of(50, 60, 70).tiles, 1);
    }

    /// Into memory holding NaNs (standing for uninitialised memory), a product with rows
    /// `stride` apart writes its whole block, as `par_matmul` does, reads none of it, and
    /// leaves the gap between rows alone; in f32 and, where the CPU has it, bf16.
    #[test]
    fn a_product_into_uninitialised_memory_writes_its_block_whole_and_nothing_else() {
        use std::mem::MaybeUninit;
        let (m, n, k, stride) = (300, 70, 40, 75);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 31) % 17) as f32 - 8.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 7) % 13) as f32 / 4.0).collect();
        let (lhs, rhs) = (Mat::rows(&a, m, k), Mat::rows(&b, k, n));
        for precision in [Precision::F32, Precision::Bf16] {
            if !available(precision) {
                eprintln!("SKIPPED: {} (this CPU lacks it)", precision.name());
                continue;
            }
            let mut want = vec![f32::NAN; m * stride];
            par_matmul(&mut want, stride, lhs, rhs, false, precision);
            let mut got = vec![MaybeUninit::new(f32::NAN); m * stride];
            par_matmul_uninit(&mut got, stride, lhs, rhs, None, precision);
            for (at, (g, w)) in got.iter().zip(&want).enumerate() {
                // SAFETY: every element was initialised (to NaN) above.
                let g = unsafe { g.assume_init() };
                let in_block = at % stride < n;
                assert!(
                    g.to_bits() == w.to_bits() && (in_block != g.is_nan()),
                    "{} element {at}: {g} against {w}",
                    precision.name()
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "overruns")]
    fn a_view_larger_than_its_slice_is_refused() {
        let a = vec![0.0; 10];
        let mut dst = vec![0.0; 16];
        matmul(
            &mut dst,
            4,
            Mat::rows(&a, 4, 4),
            Mat::rows(&a, 4, 4),
            false,
            Precision::F32,
        );
    }
}
