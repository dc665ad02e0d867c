//! A safe face on the `gemm` crate: strided matrix views checked against their slices.
//!
//! Every call runs on the calling thread (`Parallelism::None`): the kernels parallelise over
//! chunks of images themselves, so that the result of a chunk never depends on how many threads
//! there are.

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

/// `dst = lhs · rhs`, or `dst += lhs · rhs` when `accumulate`; `dst` is row-major with
/// `dst_stride` between rows.
pub fn matmul(dst: &mut [f32], dst_stride: usize, lhs: Mat, rhs: Mat, accumulate: bool) {
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    assert_eq!(rhs.rows, k, "matmul: inner dimensions differ");
    lhs.check("matmul lhs");
    rhs.check("matmul rhs");
    assert!(
        fits(dst.len(), m, n, dst_stride, 1),
        "matmul: a {m}×{n} destination with row stride {dst_stride} overruns its {} elements",
        dst.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in dst.chunks_mut(dst_stride).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: every view was checked above to lie inside its slice, and `dst` is borrowed
    // mutably while the inputs are shared borrows, so they cannot overlap.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
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
    fn transposed_views_and_accumulation_match_a_naive_product() {
        let a: Vec<f32> = (0..35).map(|i| (i % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..20).map(|i| (i % 5) as f32 * 0.5).collect();
        // a is 5×7 stored row-major; use its transpose (7×5) times b (5×4).
        let lhs = Mat::rows(&a, 5, 7).t();
        let rhs = Mat::rows(&b, 5, 4);
        let mut dst = vec![1.0; 28];
        matmul(&mut dst, 4, lhs, rhs, false);
        assert_eq!(dst, naive(lhs, rhs));
        matmul(&mut dst, 4, lhs, rhs, true);
        let twice: Vec<f32> = naive(lhs, rhs).iter().map(|v| 2.0 * v).collect();
        assert_eq!(dst, twice);
    }

    #[test]
    #[should_panic(expected = "overruns")]
    fn a_view_larger_than_its_slice_is_refused() {
        let a = vec![0.0; 10];
        let mut dst = vec![0.0; 16];
        matmul(&mut dst, 4, Mat::rows(&a, 4, 4), Mat::rows(&a, 4, 4), false);
    }
}
