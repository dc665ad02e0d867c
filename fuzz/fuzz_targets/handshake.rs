//! The first frame of every connection: the hello and the reply to it.
#![no_main]
use collective::wire::{HandshakeReply, Hello};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(hello) = Hello::decode(data) {
        assert_eq!(Hello::decode(&hello.encode()).ok(), Some(hello));
    }
    if let Ok(reply) = HandshakeReply::decode(data) {
        assert_eq!(HandshakeReply::decode(&reply.encode()).ok(), Some(reply));
    }
});
