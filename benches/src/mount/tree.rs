//! The tree every target of `kiln-bench mount` extracts: Debian's `linux-source` tarball
//! decompressed into a plain tar, or a tree generated from one seed and packed with
//! `tar -cf`; and what `tar -tvf` counts in it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;

use super::round;
use crate::process::{check_stop, run_bounded};
use crate::report::Reporter;
use crate::rng::Rng;

/// Where the tree comes from.
#[derive(Debug, Clone)]
pub enum TreeSource {
    Generated(TreeShape),
    /// A (possibly compressed) tarball, such as Debian's `linux-source`.
    Tarball(PathBuf),
}

/// A generated tree.
#[derive(Debug, Clone, Copy)]
pub struct TreeShape {
    pub files: usize,
    /// Directories, the top one included.
    pub dirs: usize,
    pub seed: u64,
}

/// Files in the default generated tree (about the Linux kernel source's count).
pub const DEFAULT_FILES: usize = 80_000;
/// Directories in the default generated tree.
pub const DEFAULT_DIRS: usize = 5_000;
/// The default seed of the generated tree.
pub const DEFAULT_SEED: u64 = 0x6b69_6c6e;
/// Where Debian's `linux-source` package puts its tarball.
const LINUX_SOURCE_DIR: &str = "/usr/src";
/// Median size of a generated file.
const FILE_BYTES_MEDIAN: f64 = 4096.0;
/// σ of the log-normal sizes (the tail: ~1 file in 100 above 80 KiB).
const FILE_BYTES_SIGMA: f64 = 1.3;
/// Largest generated file.
const FILE_BYTES_MAX: usize = 1 << 20;
/// The generated tree's top directory, inside the tarball.
const TREE_TOP: &str = "tree";
/// Longest preparation step (generating, packing or decompressing the tree).
const PREPARE_TIMEOUT: Duration = Duration::from_secs(3600);

/// Resolves `--files`, `--dirs` and `--linux-source` (`auto`, `off` or a path): an explicit
/// size or `off` generates a tree; `auto` takes the installed `linux-source` tarball if there
/// is one.
pub fn tree_source(
    files: Option<usize>,
    dirs: Option<usize>,
    seed: u64,
    linux_source: &str,
) -> anyhow::Result<TreeSource> {
    let generated = TreeSource::Generated(TreeShape {
        files: files.unwrap_or(DEFAULT_FILES),
        dirs: dirs.unwrap_or(DEFAULT_DIRS).max(1),
        seed,
    });
    let sized = files.is_some() || dirs.is_some();
    match linux_source {
        "off" | "no" => Ok(generated),
        "auto" if sized => Ok(generated),
        "auto" => Ok(linux_source_tarball().map_or(generated, TreeSource::Tarball)),
        path if sized => {
            bail!("--linux-source {path} and --files/--dirs: choose a tarball or a generated tree")
        }
        path => {
            let path = PathBuf::from(path);
            if !path.is_file() {
                bail!("--linux-source {}: no such file", path.display());
            }
            Ok(TreeSource::Tarball(path))
        }
    }
}

/// The newest `/usr/src/linux-source-*.tar.*`, if Debian's `linux-source` is installed.
pub fn linux_source_tarball() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(LINUX_SOURCE_DIR)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("linux-source-") && n.contains(".tar"))
                && p.is_file()
        })
        .collect();
    found.sort();
    found.pop()
}

/// The tarball every target extracts, and what is in it.
#[derive(Debug)]
pub(super) struct Tree {
    pub(super) tarball: PathBuf,
    pub(super) tar_bytes: u64,
    pub(super) files: u64,
    pub(super) dirs: u64,
    /// Bytes of the regular files.
    pub(super) file_bytes: u64,
}

/// Makes `root/tree.tar` (generated, or the linux-source tarball decompressed) and counts it.
pub(super) fn prepare_tree(
    source: &TreeSource,
    root: &Path,
    logs: &Path,
    out: &mut Reporter,
) -> anyhow::Result<Tree> {
    let tarball = root.join("tree.tar");
    let start = Instant::now();
    let source = match source {
        TreeSource::Generated(shape) => {
            let gen_dir = root.join("gen");
            generate(*shape, &gen_dir)?;
            let mut tar = Command::new("tar");
            tar.arg("-cf")
                .arg(&tarball)
                .arg("-C")
                .arg(&gen_dir)
                .arg(TREE_TOP);
            run_bounded(&mut tar, None, &logs.join("prepare.log"), PREPARE_TIMEOUT)?;
            std::fs::remove_dir_all(&gen_dir)
                .with_context(|| format!("cannot remove {}", gen_dir.display()))?;
            json!({ "generated": { "files": shape.files, "dirs": shape.dirs, "seed": shape.seed,
                    "size": format!("log-normal, median {FILE_BYTES_MEDIAN} B, sigma {FILE_BYTES_SIGMA}, at most {FILE_BYTES_MAX} B") } })
        }
        TreeSource::Tarball(path) => {
            decompress(path, &tarball, logs)?;
            json!({ "tarball": path.display().to_string() })
        }
    };
    let prepared_s = start.elapsed().as_secs_f64();
    let tree = count_tarball(&tarball)?;
    out.note(
        "tree",
        &json!({
            "source": source,
            "files": tree.files,
            "dirs": tree.dirs,
            "file_bytes": tree.file_bytes,
            "tar_bytes": tree.tar_bytes,
            "prepared_s": round(prepared_s),
        }),
    );
    Ok(tree)
}

/// A generated file's size: log-normal around the median, capped.
fn file_size(rng: &mut Rng) -> usize {
    let size = FILE_BYTES_MEDIAN * (FILE_BYTES_SIGMA * rng.normal()).exp();
    (size.round() as usize).min(FILE_BYTES_MAX)
}

/// Source-like endings, so names look like a source tree.
const EXTENSIONS: [&str; 6] = [".c", ".h", ".c", ".h", ".S", ".txt"];

/// Writes the generated tree under `dir/tree`: directory `i` hangs under one of the
/// directories before it (chosen as `i·u²`, so near the top), files land in random
/// directories. Every choice comes from `shape.seed`.
fn generate(shape: TreeShape, dir: &Path) -> anyhow::Result<()> {
    let mut rng = Rng::new(shape.seed);
    let dirs = shape.dirs.max(1);
    let mut paths: Vec<PathBuf> = Vec::with_capacity(dirs);
    let top = dir.join(TREE_TOP);
    std::fs::create_dir_all(&top).with_context(|| format!("cannot create {}", top.display()))?;
    paths.push(top);
    for i in 1..dirs {
        let u = rng.unit();
        let parent = ((i as f64) * u * u) as usize;
        let path = paths[parent.min(i - 1)].join(format!("d{i:04}"));
        std::fs::create_dir(&path).with_context(|| format!("cannot create {}", path.display()))?;
        paths.push(path);
    }
    // Text to cut files from: words and newlines.
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz_(){};=     \n";
    let text: Vec<u8> = (0..2 * FILE_BYTES_MAX)
        .map(|_| ALPHABET[rng.below(ALPHABET.len())])
        .collect();
    for j in 0..shape.files {
        if j % 1024 == 0 {
            check_stop()?;
        }
        let d = rng.below(dirs);
        let size = file_size(&mut rng);
        let offset = rng.below(text.len() - size + 1);
        let path = paths[d].join(format!("f{j:06}{}", EXTENSIONS[j % EXTENSIONS.len()]));
        std::fs::write(&path, &text[offset..offset + size])
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Decompresses `src` (by its extension) into the plain tar `dst`.
fn decompress(src: &Path, dst: &Path, logs: &Path) -> anyhow::Result<()> {
    let name = src.to_string_lossy();
    let tool = [
        (".xz", "xz"),
        (".bz2", "bzip2"),
        (".gz", "gzip"),
        (".zst", "zstd"),
    ]
    .into_iter()
    .find(|(ext, _)| name.ends_with(ext))
    .map(|(_, tool)| tool);
    match tool {
        None => {
            std::fs::copy(src, dst)
                .with_context(|| format!("cannot copy {} to {}", src.display(), dst.display()))?;
        }
        Some(tool) => {
            let file = std::fs::File::create(dst)
                .with_context(|| format!("cannot create {}", dst.display()))?;
            let mut cmd = Command::new(tool);
            cmd.arg("-dc").arg(src);
            run_bounded(
                &mut cmd,
                Some(file),
                &logs.join("prepare.log"),
                PREPARE_TIMEOUT,
            )?;
        }
    }
    Ok(())
}

/// Counts the entries of `tarball` from `tar -tvf`: directories, everything else as files
/// (regular files, links), and the bytes of the regular files.
fn count_tarball(tarball: &Path) -> anyhow::Result<Tree> {
    let listing = Command::new("tar")
        .arg("-tvf")
        .arg(tarball)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .output()
        .context("cannot run tar -tvf")?;
    if !listing.status.success() {
        bail!(
            "tar -tvf {}: {}",
            tarball.display(),
            String::from_utf8_lossy(&listing.stderr).trim()
        );
    }
    let (mut files, mut dirs, mut file_bytes) = (0u64, 0u64, 0u64);
    for line in String::from_utf8_lossy(&listing.stdout).lines() {
        // `-rw-r--r-- root/root 1234 2024-01-01 12:00 path`
        let mut fields = line.split_whitespace();
        let (Some(mode), Some(size)) = (fields.next(), fields.nth(1)) else {
            continue;
        };
        match mode.as_bytes().first() {
            Some(b'd') => dirs += 1,
            Some(b'-') => {
                files += 1;
                file_bytes += size.parse::<u64>().unwrap_or(0);
            }
            Some(_) => files += 1,
            None => {}
        }
    }
    if files + dirs == 0 {
        bail!("{} holds no entries", tarball.display());
    }
    Ok(Tree {
        tar_bytes: std::fs::metadata(tarball)?.len(),
        tarball: tarball.to_owned(),
        files,
        dirs,
        file_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_sizes_have_the_asked_median_and_a_tail() {
        let mut rng = Rng::new(DEFAULT_SEED);
        let mut sizes: Vec<usize> = (0..20_000).map(|_| file_size(&mut rng)).collect();
        sizes.sort_unstable();
        let median = sizes[sizes.len() / 2];
        assert!((3500..4700).contains(&median), "median {median}");
        assert!(sizes[sizes.len() * 99 / 100] > 50_000, "no tail");
        assert!(sizes.iter().all(|&s| s <= FILE_BYTES_MAX));
    }

    #[test]
    fn sizes_or_off_generate_and_a_missing_path_fails() {
        let t = tree_source(Some(10), None, 1, "auto").expect("sized");
        assert!(matches!(t, TreeSource::Generated(s) if s.files == 10 && s.dirs == DEFAULT_DIRS));
        assert!(matches!(
            tree_source(None, None, 1, "off").expect("off"),
            TreeSource::Generated(_)
        ));
        assert!(tree_source(None, None, 1, "/nonexistent/linux.tar.xz").is_err());
        assert!(tree_source(Some(1), None, 1, "/nonexistent/linux.tar.xz").is_err());
    }
}
