//! Store requests from the network: decode never panics, and what decodes re-encodes the same.
#![no_main]
use collective::store::Request;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = Request::decode(data) {
        assert_eq!(Request::decode(&req.encode()).ok(), Some(req));
    }
});
