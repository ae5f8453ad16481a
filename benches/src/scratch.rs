//! Where a benchmark writes: a temporary directory, or — as root — a fresh ext4 file system
//! in a loop image, because the root file system here (mounted with `discard`) swings 10×
//! between runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// A scratch directory, unmounted and removed when dropped.
#[derive(Debug)]
pub struct Scratch {
    dir: tempfile::TempDir,
    mounted: bool,
    pub fs: String,
}

fn run(cmd: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("running {cmd}"))?;
    if !out.status.success() {
        bail!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Scratch {
    /// `under`: where to make the directory (default: the system temp dir). `loop_mib`: when
    /// set, mount a fresh ext4 of that size there first, with `loop_inodes` inodes when given
    /// (mkfs's default is one per 16 KiB: too few for millions of small files).
    pub fn new(
        under: Option<&Path>,
        loop_mib: Option<u64>,
        loop_inodes: Option<u64>,
    ) -> anyhow::Result<Scratch> {
        let dir = match under {
            Some(p) => tempfile::tempdir_in(p)?,
            None => tempfile::tempdir()?,
        };
        let Some(mib) = loop_mib else {
            if loop_inodes.is_some() {
                bail!("--loop-fs-inodes needs --loop-fs-mib");
            }
            return Ok(Scratch {
                fs: fs_type(dir.path()),
                dir,
                mounted: false,
            });
        };
        if !rustix::process::geteuid().is_root() {
            bail!("--loop-fs needs root (it mounts a loop image)");
        }
        let image = dir.path().join("fs.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt)?;
        let file = std::fs::File::create(&image)?;
        file.set_len(mib << 20)?;
        let (image_s, mnt_s) = (
            image.to_string_lossy().into_owned(),
            mnt.to_string_lossy().into_owned(),
        );
        let inodes = loop_inodes.map(|n| n.to_string());
        let mut mkfs = vec!["-q", "-F", "-E", "nodiscard"];
        if let Some(n) = &inodes {
            mkfs.extend(["-N", n]);
        }
        mkfs.push(&image_s);
        run("mkfs.ext4", &mkfs)?;
        run("mount", &["-o", "loop", &image_s, &mnt_s])?;
        let fs = match loop_inodes {
            Some(n) => format!("ext4 (fresh loop image, {mib} MiB, {n} inodes asked)"),
            None => format!("ext4 (fresh loop image, {mib} MiB)"),
        };
        Ok(Scratch {
            fs,
            dir,
            mounted: true,
        })
    }

    pub fn path(&self) -> PathBuf {
        match self.mounted {
            true => self.dir.path().join("mnt"),
            false => self.dir.path().to_owned(),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.mounted {
            // Engine threads may hold directory fds for a moment longer (EBUSY): retry, then
            // detach lazily so no mount outlives the benchmark.
            let path = self.path().to_string_lossy().into_owned();
            for _ in 0..50 {
                if run("umount", &[&path]).is_ok() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = run("umount", &["-l", &path]);
        }
    }
}

/// The type of the file system `path` is on, by name where known.
pub fn fs_type(path: &Path) -> String {
    match rustix::fs::statfs(path) {
        Ok(s) => match s.f_type {
            0xEF53 => "ext4".into(),
            0x5846_5342 => "xfs".into(),
            0x0102_1994 => "tmpfs".into(),
            0x9123_683E => "btrfs".into(),
            0x6573_5546 => "fuse".into(),
            other => format!("fs type {other:#x}"),
        },
        Err(_) => "unknown".into(),
    }
}

/// Writes out the dirty data and metadata of the file systems holding `paths` (`syncfs`), so
/// that dropping the caches afterwards drops everything they cache.
pub fn sync_file_systems(paths: &[&Path]) {
    for path in paths {
        if let Ok(dir) = std::fs::File::open(path) {
            let _ = rustix::fs::syncfs(&dir);
        }
    }
}

/// Drops the kernel's clean page, dentry and inode caches (`echo 3 >
/// /proc/sys/vm/drop_caches`; root only). Whatever is still dirty stays: sync first.
pub fn drop_caches() -> std::io::Result<()> {
    std::fs::write("/proc/sys/vm/drop_caches", "3")
}
