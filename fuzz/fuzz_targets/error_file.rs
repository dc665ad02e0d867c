//! torchrun's error files (what a worker's `@record` writes, read back for the root cause):
//! any bytes are read or refused without a panic, and what is read stays one screen.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(e) = launcher::error_file::parse(data) {
        assert!(e.message.chars().count() <= 503);
        assert!(e.frames.len() <= launcher::error_file::FRAMES);
    }
});
