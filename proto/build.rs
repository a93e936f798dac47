//! Generates the tonic/prost code. protoc comes from the protoc-bin-vendored crate, so building
//! needs no system package.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded at this point.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    tonic_prost_build::configure()
        // KvService's keys and values are `bytes::Bytes`: decoded as views of the received
        // buffer and handed on without a copy, from the SDK's caller to the KN's cache and
        // back (issue 12: values are `Bytes` end to end).
        .bytes(".dinomo.kv.v1")
        .compile_protos(
            &[
                "proto/dpm.proto",
                "proto/kv.proto",
                "proto/routing.proto",
                "proto/monitor.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
