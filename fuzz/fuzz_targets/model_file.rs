//! Model files (safetensors header, `trainctl.model` metadata, tensors): reading one never
//! panics, and what is accepted names a known network and a class count within the limits.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((architecture, classes)) = trainer::fuzzing::model_file(data) {
        assert!(trainer::model::Architecture::parse(&architecture).is_some());
        assert!((1..=trainer::model::MAX_CLASSES).contains(&classes));
    }
});
