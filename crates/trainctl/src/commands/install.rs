//! `trainctl install DIR`: this binary, copied into DIR. The init container of a training pod
//! whose image lacks trainctl runs it from trainctl's image into an emptyDir that the training
//! container then runs `DIR/trainctl` from. It needs no shell or `cp` in trainctl's image.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Args)]
pub(crate) struct Args {
    /// An existing, writable directory.
    dir: PathBuf,
}

pub(crate) fn run(args: Args) -> anyhow::Result<i32> {
    let dir = &args.dir;
    anyhow::ensure!(
        dir.is_dir(),
        "cannot install into {}: not a directory (create it first; in a pod it is the emptyDir \
         the init container mounts)",
        dir.display()
    );
    let exe = std::env::current_exe().context("cannot find this program's own file")?;
    let mut source =
        std::fs::File::open(&exe).with_context(|| format!("cannot read {}", exe.display()))?;
    let dest = dir.join(deploy::manifests::BINARY);
    // Whole or not at all: a pod that starts on a half-copied binary would fail obscurely.
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        deploy::manifests::BINARY,
        std::process::id()
    ));
    let written = (|| -> std::io::Result<u64> {
        let mut f = std::fs::File::create(&tmp)?;
        let n = std::io::copy(&mut source, &mut f)?;
        f.flush()?;
        f.set_permissions(std::fs::Permissions::from_mode(0o755))?;
        f.sync_all()?;
        std::fs::rename(&tmp, &dest)?;
        Ok(n)
    })();
    let bytes = match written {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e).with_context(|| format!("cannot install into {}", dir.display()));
        }
    };
    println!("installed {} ({bytes} bytes)", dest.display());
    Ok(0)
}
