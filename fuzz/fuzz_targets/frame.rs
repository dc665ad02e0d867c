//! A stream of frames from a hostile peer: every read ends in a frame, an error or EOF.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut cursor = std::io::Cursor::new(data);
    // A small limit, so huge announced lengths are refused rather than allocated.
    while let Ok(Some(frame)) = collective::wire::read_frame(&mut cursor, 1 << 16) {
        assert!(frame.len() <= 1 << 16);
    }
});
