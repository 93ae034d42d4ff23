//! The remote tier's control decoder: frames and requests from untrusted workers. Every input
//! is either a request within the limits or a clear error; none panics, none allocates past
//! the frame limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru_remote::proto;

fuzz_target!(|data: &[u8]| {
    let mut body = Vec::new();
    let mut stream = data;
    while let Ok(Some(())) = proto::read_frame(&mut stream, &mut body) {
        assert!(body.len() <= proto::MAX_FRAME);
        if let Ok(req) = proto::decode_request(&body) {
            assert!(req.op.items() <= proto::MAX_ITEMS);
        }
    }
    if let Ok(req) = proto::decode_request(data) {
        assert!(req.op.items() <= proto::MAX_ITEMS);
        // What decodes re-encodes to the same request.
        let mut frame = Vec::new();
        proto::write_frame(&mut frame, &req).expect("encode");
        let mut again = Vec::new();
        proto::read_frame(&mut frame.as_slice(), &mut again).expect("frame");
        assert_eq!(proto::decode_request(&again).expect("decode"), req);
    }
});
