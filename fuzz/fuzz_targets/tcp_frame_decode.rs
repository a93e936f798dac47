//! See `dinomo_fuzz::tcp_frame_decode` for the input format and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dinomo_fuzz::tcp_frame_decode(data));
