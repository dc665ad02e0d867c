pub fn run(_args: Args) -> anyhow::Result<i32> {
    Ok(0)
}
#[derive(clap::Args)]
pub struct Args {}
