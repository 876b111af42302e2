fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=motley/v1/agent.proto");
    let fds = protox::compile(["motley/v1/agent.proto"], ["."])?;
    tonic_prost_build::compile_fds(fds)?;
    Ok(())
}
