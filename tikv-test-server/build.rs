//! Generates the protobuf messages of TiKV's and PD's gRPC protocols from the `.proto` files
//! that the `tikv-client` crate ships, with a vendored `protoc`. The test server then speaks the
//! exact wire format the real client expects.

use std::path::{Path, PathBuf};

const TIKV_CLIENT_DIR: &str = "tikv-client-0.4.0";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=TIKV_PROTO_DIR");
    let proto_dir = find_proto_dir().unwrap_or_else(|| {
        panic!(
            "cannot find the .proto files of {TIKV_CLIENT_DIR} in cargo's registry; \
             fetch it with `cargo fetch` or set TIKV_PROTO_DIR to its proto/ folder"
        )
    });
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc");
    // SAFETY: a build script is single-threaded here; prost-build reads PROTOC.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let protos: Vec<PathBuf> = [
        "kvrpcpb.proto",
        "pdpb.proto",
        "metapb.proto",
        "errorpb.proto",
        "keyspacepb.proto",
    ]
    .iter()
    .map(|p| proto_dir.join(p))
    .collect();
    prost_build::Config::new()
        .compile_protos(&protos, &[proto_dir.clone(), proto_dir.join("include")])
        .expect("compile TiKV's protocol definitions");

    // One module per generated package, side by side, as the generated code refers to its
    // neighbours through `super::`.
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let mut modules: Vec<String> = std::fs::read_dir(&out_dir)
        .expect("read OUT_DIR")
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter_map(|name| name.strip_suffix(".rs").map(str::to_string))
        .filter(|name| name != "all" && !name.contains('.'))
        .collect();
    modules.sort();
    let all: String = modules
        .iter()
        .map(|name| {
            format!("pub mod {name} {{ include!(concat!(env!(\"OUT_DIR\"), \"/{name}.rs\")); }}\n")
        })
        .collect();
    std::fs::write(out_dir.join("all.rs"), all).expect("write all.rs");
}

fn find_proto_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("TIKV_PROTO_DIR") {
        return Some(PathBuf::from(dir));
    }
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cargo")))?;
    let registries = std::fs::read_dir(cargo_home.join("registry").join("src")).ok()?;
    registries
        .filter_map(Result::ok)
        .map(|entry| entry.path().join(TIKV_CLIENT_DIR).join("proto"))
        .find(|dir| dir.join("kvrpcpb.proto").is_file())
}
