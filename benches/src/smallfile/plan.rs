//! What `kiln-bench smallfile` does, the same on every target: the ops, the plan of steps
//! that runs them in order (with unmeasured set-up and clean-up steps), and the layout of
//! directories, files and GFIDs.

use kiln_wire::Gfid;

use crate::bricks::seeded_gfid;

/// One smallfile operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum SmallfileOp {
    Create,
    Read,
    Append,
    Stat,
    Chmod,
    Rename,
    Delete,
    Mkdir,
    Rmdir,
    Readdir,
    LsL,
    Setxattr,
    Getxattr,
}

impl SmallfileOp {
    /// The default sequence: each op's precondition is left by the ones before it.
    pub const SEQUENCE: [SmallfileOp; 13] = [
        SmallfileOp::Create,
        SmallfileOp::Stat,
        SmallfileOp::Read,
        SmallfileOp::Append,
        SmallfileOp::Chmod,
        SmallfileOp::Setxattr,
        SmallfileOp::Getxattr,
        SmallfileOp::LsL,
        SmallfileOp::Readdir,
        SmallfileOp::Rename,
        SmallfileOp::Delete,
        SmallfileOp::Mkdir,
        SmallfileOp::Rmdir,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SmallfileOp::Create => "create",
            SmallfileOp::Read => "read",
            SmallfileOp::Append => "append",
            SmallfileOp::Stat => "stat",
            SmallfileOp::Chmod => "chmod",
            SmallfileOp::Rename => "rename",
            SmallfileOp::Delete => "delete",
            SmallfileOp::Mkdir => "mkdir",
            SmallfileOp::Rmdir => "rmdir",
            SmallfileOp::Readdir => "readdir",
            SmallfileOp::LsL => "ls-l",
            SmallfileOp::Setxattr => "setxattr",
            SmallfileOp::Getxattr => "getxattr",
        }
    }

    /// Listing ops go directory by directory; the others file by file.
    pub(super) fn per_directory(self) -> bool {
        matches!(self, SmallfileOp::Readdir | SmallfileOp::LsL)
    }
}

/// The extended attribute set and read back, and its value's size.
pub(super) const XATTR_NAME: &str = "user.kiln-bench";
pub(super) const XATTR_VALUE_BYTES: usize = 64;
/// The mode chmod sets.
pub(super) const CHMOD_MODE: u32 = 0o640;
/// The suffix rename adds (and a second rename takes away).
const RENAMED_SUFFIX: &str = ".renamed";

/// One step of the plan: an op and what the files look like when it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanStep {
    pub op: SmallfileOp,
    /// False for a step that only sets up a later op's precondition (or cleans up).
    pub measured: bool,
    /// The files carry the renamed name when the step starts.
    pub(super) renamed: bool,
    /// Every file's size when the step starts.
    pub(super) size: usize,
}

/// The steps that run `ops` in order, with unmeasured set-up steps where an op's
/// precondition is missing and clean-up steps at the end.
pub fn plan(ops: &[SmallfileOp], file_bytes: usize) -> Vec<PlanStep> {
    let mut steps = Vec::new();
    let (mut files, mut renamed, mut xattr, mut size, mut dirs) = (false, false, false, 0, false);
    let mut push = |op, measured, renamed, size| {
        steps.push(PlanStep {
            op,
            measured,
            renamed,
            size,
        });
    };
    for &op in ops {
        match op {
            SmallfileOp::Create | SmallfileOp::Delete => {}
            SmallfileOp::Mkdir if dirs => push(SmallfileOp::Rmdir, false, renamed, size),
            SmallfileOp::Rmdir if !dirs => push(SmallfileOp::Mkdir, false, renamed, size),
            SmallfileOp::Mkdir | SmallfileOp::Rmdir => {}
            _ if !files => {
                push(SmallfileOp::Create, false, false, 0);
                (files, renamed, xattr, size) = (true, false, false, file_bytes);
            }
            _ => {}
        }
        match op {
            SmallfileOp::Create if files => push(SmallfileOp::Delete, false, renamed, size),
            SmallfileOp::Delete if !files => {
                push(SmallfileOp::Create, false, false, 0);
                (files, renamed, xattr, size) = (true, false, false, file_bytes);
            }
            SmallfileOp::Getxattr if !xattr => push(SmallfileOp::Setxattr, false, renamed, size),
            _ => {}
        }
        push(op, true, renamed, size);
        match op {
            SmallfileOp::Create => (files, renamed, xattr, size) = (true, false, false, file_bytes),
            SmallfileOp::Delete => (files, xattr) = (false, false),
            SmallfileOp::Append => size += file_bytes,
            SmallfileOp::Rename => renamed = !renamed,
            SmallfileOp::Setxattr | SmallfileOp::Getxattr => xattr = true,
            SmallfileOp::Mkdir => dirs = true,
            SmallfileOp::Rmdir => dirs = false,
            _ => {}
        }
    }
    if files {
        push(SmallfileOp::Delete, false, renamed, size);
    }
    if dirs {
        push(SmallfileOp::Rmdir, false, renamed, size);
    }
    steps
}

/// Where everything is, the same on every target.
#[derive(Debug, Clone)]
pub(super) struct Layout {
    pub(super) files: usize,
    pub(super) fanout: usize,
    pub(super) file_bytes: usize,
    /// Bytes per write(2) on the syscall targets, at least 1.
    pub(super) record_bytes: usize,
    pub(super) seed: u64,
}

/// What a GFID is for (its stream of the seed).
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    Top = 1,
    FileDir = 2,
    File = 3,
    MkdirDir = 4,
    Mkdir = 5,
}

impl Layout {
    /// Directories of files per thread (and of mkdir's directories).
    pub(super) fn dirs(&self) -> usize {
        self.files.div_ceil(self.fanout).max(1)
    }

    pub(super) fn files_in(&self, k: usize) -> usize {
        self.fanout.min(self.files - k * self.fanout)
    }

    pub(super) fn top(t: usize) -> String {
        format!("t{t:03}")
    }

    pub(super) fn dir(k: usize) -> String {
        format!("d{k:05}")
    }

    pub(super) fn mkdir_dir(k: usize) -> String {
        format!("m{k:05}")
    }

    pub(super) fn file(i: usize, renamed: bool) -> String {
        match renamed {
            false => format!("f{i:07}"),
            true => format!("f{i:07}{RENAMED_SUFFIX}"),
        }
    }

    pub(super) fn subdir(i: usize) -> String {
        format!("s{i:07}")
    }

    /// The GFID of object `i` of `kind` in thread `t`, from the seed.
    pub(super) fn gfid(&self, kind: Kind, t: usize, i: usize) -> Gfid {
        seeded_gfid(self.seed, (kind as u64) << 56 | (t as u64) << 32 | i as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(plan: &[PlanStep]) -> Vec<String> {
        plan.iter()
            .map(|s| match s.measured {
                true => s.op.name().to_owned(),
                false => format!("({})", s.op.name()),
            })
            .collect()
    }

    #[test]
    fn the_default_sequence_needs_no_set_up_and_cleans_nothing_up() {
        let steps = plan(&SmallfileOp::SEQUENCE, 10);
        assert!(steps.iter().all(|s| s.measured), "{:?}", ops(&steps));
        assert_eq!(steps.len(), SmallfileOp::SEQUENCE.len());
        let at = |op| steps.iter().find(|s| s.op == op).expect("op in plan");
        assert_eq!(at(SmallfileOp::Read).size, 10);
        assert_eq!(at(SmallfileOp::Getxattr).size, 20, "after one append");
        assert!(!at(SmallfileOp::Rename).renamed && at(SmallfileOp::Delete).renamed);
    }

    #[test]
    fn missing_preconditions_are_set_up_unmeasured() {
        assert_eq!(
            ops(&plan(&[SmallfileOp::Read], 4)),
            ["(create)", "read", "(delete)"]
        );
        assert_eq!(
            ops(&plan(&[SmallfileOp::Getxattr, SmallfileOp::Rmdir], 4)),
            [
                "(create)",
                "(setxattr)",
                "getxattr",
                "(mkdir)",
                "rmdir",
                "(delete)"
            ]
        );
        assert_eq!(
            ops(&plan(
                &[SmallfileOp::Create, SmallfileOp::Create, SmallfileOp::Mkdir],
                4
            )),
            [
                "create", "(delete)", "create", "mkdir", "(delete)", "(rmdir)"
            ]
        );
        assert_eq!(
            ops(&plan(&[SmallfileOp::Delete], 4)),
            ["(create)", "delete"]
        );
        let twice = plan(
            &[SmallfileOp::Rename, SmallfileOp::Rename, SmallfileOp::Stat],
            4,
        );
        let renamed: Vec<bool> = twice.iter().map(|s| s.renamed).collect();
        assert_eq!(renamed, [false, false, true, false, false]);
    }

    #[test]
    fn layout_spreads_files_over_directories() {
        let layout = Layout {
            files: 25,
            fanout: 10,
            file_bytes: 1,
            record_bytes: 1,
            seed: 1,
        };
        assert_eq!(layout.dirs(), 3);
        assert_eq!(
            (0..3).map(|k| layout.files_in(k)).collect::<Vec<_>>(),
            [10, 10, 5]
        );
        assert_ne!(layout.gfid(Kind::File, 0, 1), layout.gfid(Kind::File, 1, 0));
        assert_eq!(layout.gfid(Kind::Top, 2, 0), layout.gfid(Kind::Top, 2, 0));
    }
}
