fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["motley/v1/agent.proto", "motley/v1/control.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    tonic_prost_build::compile_fds(fds)?;
    Ok(())
}
