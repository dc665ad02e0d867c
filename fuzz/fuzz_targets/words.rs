//! tiny-imagenet's `words.txt`: never a panic, never more classes than lines.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    assert!(trainer::fuzzing::words(&text) <= text.lines().count());
});
