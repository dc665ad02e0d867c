//! The shape of a convolution and what follows from it alone.

/// The im2col matrix of one chunk is kept under this size (bytes)...
const CHUNK_COL_BYTES: usize = 4 << 20;
/// ...and under this many rows (output pixels).
const CHUNK_MAX_ROWS: usize = 4096;

/// The shape of a convolution: input `[batch, height, width, c_in]` (NHWC), weight
/// `[c_out, c_in, kernel[0], kernel[1]]` (PyTorch's layout), no dilation, one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ConvShape {
    pub batch: usize,
    pub c_in: usize,
    pub height: usize,
    pub width: usize,
    pub c_out: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl ConvShape {
    /// A 3×3 convolution at stride 1 with padding 1 on square inputs (`size` × `size`): every
    /// convolution of the seed CNN.
    pub(crate) fn same_3x3(batch: usize, c_in: usize, c_out: usize, size: usize) -> Self {
        ConvShape {
            batch,
            c_in,
            height: size,
            width: size,
            c_out,
            kernel: [3, 3],
            stride: [1, 1],
            padding: [1, 1],
        }
    }

    /// Checks that the shape describes a convolution with at least one output pixel.
    pub fn validate(&self) -> Result<(), String> {
        let dims = [
            ("batch", self.batch),
            ("input channels", self.c_in),
            ("height", self.height),
            ("width", self.width),
            ("output channels", self.c_out),
            ("kernel height", self.kernel[0]),
            ("kernel width", self.kernel[1]),
            ("vertical stride", self.stride[0]),
            ("horizontal stride", self.stride[1]),
        ];
        if let Some((name, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return Err(format!("convolution {name} is 0 in {self:?}"));
        }
        for axis in 0..2 {
            let size = [self.height, self.width][axis] + 2 * self.padding[axis];
            if size < self.kernel[axis] {
                return Err(format!(
                    "a {}×{} kernel does not fit the padded {}×{} input",
                    self.kernel[0],
                    self.kernel[1],
                    self.height + 2 * self.padding[0],
                    self.width + 2 * self.padding[1]
                ));
            }
        }
        Ok(())
    }

    /// `3x3/1 256->256 at 4x4`: kernel, stride, channels and input size, as the profiles of
    /// `trainctl bench --layers` name a convolution.
    pub fn label(&self) -> String {
        format!(
            "{}x{}/{} {}->{} at {}x{}",
            self.kernel[0],
            self.kernel[1],
            self.stride[0],
            self.c_in,
            self.c_out,
            self.height,
            self.width
        )
    }

    /// Output height and width.
    pub fn out_size(&self) -> [usize; 2] {
        [
            (self.height + 2 * self.padding[0] - self.kernel[0]) / self.stride[0] + 1,
            (self.width + 2 * self.padding[1] - self.kernel[1]) / self.stride[1] + 1,
        ]
    }

    /// A 1×1 kernel at stride 1 without padding: on NHWC data the input, as it lies, is
    /// already the im2col matrix.
    pub(crate) fn is_pointwise(&self) -> bool {
        self.kernel == [1, 1] && self.stride == [1, 1] && self.padding == [0, 0]
    }

    /// The GEMM's inner dimension: one im2col row, `(ky, kx, c)` with `c` fastest.
    pub fn k(&self) -> usize {
        self.kernel[0] * self.kernel[1] * self.c_in
    }

    pub(crate) fn input_len(&self) -> usize {
        self.batch * self.height * self.width * self.c_in
    }

    pub fn output_len(&self) -> usize {
        let [oh, ow] = self.out_size();
        self.batch * oh * ow * self.c_out
    }

    pub(crate) fn weight_len(&self) -> usize {
        self.c_out * self.k()
    }

    pub(crate) fn rows_per_image(&self) -> usize {
        let [oh, ow] = self.out_size();
        oh * ow
    }

    /// Images per chunk: as many as keep the chunk's im2col matrix in cache.
    pub(crate) fn images_per_chunk(&self) -> usize {
        let rows = self.rows_per_image();
        let by_bytes = CHUNK_COL_BYTES / (rows * self.k() * 4).max(1);
        let by_rows = CHUNK_MAX_ROWS / rows;
        by_bytes.min(by_rows).clamp(1, self.batch)
    }
}
