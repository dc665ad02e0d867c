//! Checkpoints: the raw bytes (envelope, length, checksum) and the same bytes as a payload in
//! a valid envelope (safetensors, progress and model metadata, tensors against the network
//! they describe) are read without a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = trainer::fuzzing::checkpoint(data);
    let _ = trainer::fuzzing::checkpoint(&trainer::fuzzing::checkpoint_envelope(data));
});
