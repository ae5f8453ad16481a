//! `kiln-bench`: Kiln's workloads, each printed beside a reference from the same run.
//!
//! ```text
//! kiln-bench engine [--files N] [--dirs N] [--depths 1,16,256] [--loop-fs-mib M] [--json]
//! kiln-bench net [--files N] [--concurrency 1,16,128] [--pings N] [--bulk-mib M]
//!                [--bulk-connections 1,4] [--json]
//! kiln-bench mgmt [--sets N] [--tasks N] [--store embedded|etcd] [--no-glusterfs]
//!                 [--loop-fs-mib M] [--json]
//! kiln-bench mount [--files N] [--dirs N] [--linux-source auto|off|PATH] [--git-files N] [--mails N]
//!                  [--targets local,bindfs,kiln,kiln-dev-fuse,kiln-dist,glusterfs] [--mount-options O,...]
//!                  [--glusterfs-setup | --glusterfs-volume HOST:/VOL] [--json]
//! kiln-bench smallfile [--ops create,stat,read,...] [--targets local,engine,volume,kiln-mount,path=DIR]
//!                  [--threads N] [--files N] [--file-bytes B] [--fanout N] [--fsync] [--seed S]
//!                  [--vary KEY=V1,V2,...] [--plot FILE.svg|FILE.png] [--json]
//! kiln-bench openfds [--held 0,10,100,...] [--max-held N] [--samples N]
//!                  [--targets local,engine,volume] [--plot FILE.svg|FILE.png] [--json]
//! kiln-bench lookup-scale [--max-entries 2M] [--checkpoints 1k,10k,100k,1M,2M] [--samples N]
//!                  [--fanout N] [--depth N] [--seed S] [--plot FILE.svg|FILE.png] [--json]
//! kiln-bench rebalance [--bricks N] [--files N] [--file-kib K] [--dirs N] [--remove]
//!                  [--glusterfs] [--json]
//! ```
//!
//! Every workload takes `--json`, `--scratch DIR` and, as root, `--loop-fs-mib M` (a fresh
//! ext4 in a loop image; `--loop-fs-inodes N` for millions of files). A progress bar is
//! drawn on stderr when it is a terminal.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use kiln_bench::bricks::BrickOption;
use kiln_bench::engine::{self, EngineBench};
use kiln_bench::lookup_scale::{self, LookupScaleBench};
use kiln_bench::mgmt::{self, MgmtBench, MgmtStore};
use kiln_bench::mount::mail::{self, MailStep};
use kiln_bench::mount::{self, MountBench, Target};
use kiln_bench::net::{self, NetBench};
use kiln_bench::openfds::{self, OpenTarget, OpenfdsBench};
use kiln_bench::rebalance::{self, RebalanceBench};
use kiln_bench::report::{Reporter, environment};
use kiln_bench::scratch::Scratch;
use kiln_bench::smallfile::{self, SmallfileBench, SmallfileOp, TargetSpec};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "kiln-bench",
    version,
    about = "Kiln workloads, each with a reference measured in the same run"
)]
struct Cli {
    #[command(subcommand)]
    workload: Workload,
    /// Print JSON Lines instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Make the scratch directory under this path (default: the system temp directory).
    #[arg(long, global = true)]
    scratch: Option<PathBuf>,
    /// As root: measure on a fresh ext4 of this many MiB in a loop image (steadier than a
    /// shared root file system).
    #[arg(long, global = true)]
    loop_fs_mib: Option<u64>,
    /// Inodes of the loop ext4 (`mkfs.ext4 -N`), for millions of small files.
    #[arg(long, global = true)]
    loop_fs_inodes: Option<u64>,
}

#[derive(Debug, Subcommand)]
enum Workload {
    /// The brick engine called directly (io_uring with and without idle-worker inline runs,
    /// blocking), against std::fs loops with as many threads on the same disk.
    Engine(EngineArgs),
    /// The brick over QUIC in this process (small-file PUTs, PING round trips, 1 MiB writes
    /// and reads), against std::fs, the engine called directly and TCP on loopback.
    Net(NetArgs),
    /// The management path: `kiln volume set` through a real kiln-mgmtd (volume created, then
    /// started so each set is pushed live to a running brick) and the configuration store's
    /// commits alone and grouped, against this disk's floors: one append + fdatasync of the
    /// same bytes, and a durable file replacement (temp, fsync, rename, directory fsync). The
    /// store is the daemon's embedded log or (`--store etcd`) one etcd member. Then, where
    /// GlusterFS is installed, `gluster volume set` on a one-brick volume the run sets up.
    Mgmt(MgmtArgs),
    /// A tree of many small files untarred, `find`-stat'ed, `ls -lR`'d, read, a repository
    /// `git clone`d, and all removed, on the local directory, a bindfs passthrough FUSE mount,
    /// the Kiln mount and a GlusterFS mount (set up by the run or given), all on the scratch
    /// disk.
    Mount(MountArgs),
    /// Small-file operations in the spirit of the `smallfile` tool (create, stat, read,
    /// append, chmod, xattrs, listings, rename, delete, mkdir, rmdir), each on every target:
    /// plain syscalls on the scratch directory or any mount, the engine called directly, the
    /// brick over QUIC, a Kiln FUSE mount. Ratios against the first target.
    Smallfile(SmallfileArgs),
    /// Latency of one more open while N files are held open, N swept up to the open-file
    /// limit (raised to the hard limit first): plain files, the engine, the brick over QUIC.
    Openfds(OpenfdsArgs),
    /// LOOKUP latency by name and by GFID, cold and warm, as the brick's handle index grows
    /// to millions of entries, against fstatat on the same file system.
    LookupScale(LookupScaleArgs),
    /// A distributed volume of fresh bricks (each its own kiln-brickd) filled, a brick added
    /// and Kiln's rebalance timed (files and MiB moved per second, the 2 s layout wait left
    /// out), against a std::fs copy + unlink of as many files on the same disk, one thread.
    Rebalance(RebalanceArgs),
    /// One maildir phase of `mount`, run by it as a command of its own on a target's
    /// directory: `deliver` (each mail created, written, fsynced, closed, renamed into new/)
    /// or `read` (each new mail read and moved into cur/).
    #[command(hide = true)]
    Mail(MailArgs),
}

#[derive(Debug, Args)]
struct MailArgs {
    #[arg(value_enum)]
    step: MailStep,
    /// The maildir (made by `deliver`).
    dir: PathBuf,
    /// Mails `deliver` delivers.
    #[arg(long, default_value_t = mail::DEFAULT_MAILS)]
    mails: usize,
}

#[derive(Debug, Args)]
struct EngineArgs {
    #[arg(long, default_value_t = 100_000)]
    files: usize,
    #[arg(long, default_value_t = 100)]
    dirs: usize,
    #[arg(long, value_delimiter = ',', default_values_t = [1, 16, 256])]
    depths: Vec<usize>,
    #[arg(long, default_value_t = 4096)]
    file_bytes: usize,
    /// Files held open during the open-latency sweep; 0 means as many as the process may
    /// hold (RLIMIT_NOFILE less the brick's own fds).
    #[arg(long, value_delimiter = ',', default_values_t = [10, 1000, 10_000, 0])]
    open_sweep: Vec<usize>,
    #[arg(long, default_value_t = 2000)]
    open_samples: usize,
}

#[derive(Debug, Args)]
struct NetArgs {
    /// Files PUT at each concurrency level (and by the std::fs loop).
    #[arg(long, default_value_t = 20_000)]
    files: usize,
    #[arg(long, default_value_t = 4)]
    dirs: usize,
    #[arg(long, default_value_t = 4096)]
    file_bytes: usize,
    /// Tasks PUTting at once, sharing one connection.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 16, 128])]
    concurrency: Vec<usize>,
    /// Sequential PINGs (and TCP round trips) measured.
    #[arg(long, default_value_t = 20_000)]
    pings: usize,
    /// MiB written, then read, in 1 MiB requests.
    #[arg(long, default_value_t = 1024)]
    bulk_mib: usize,
    /// 1 MiB requests in flight during the bulk runs.
    #[arg(long, default_value_t = 8)]
    bulk_inflight: usize,
    /// Connections of the bulk client, one run per value (the TCP reference as many); above
    /// 1, large requests are spread over them and the client runtime has a thread per core.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4])]
    bulk_connections: Vec<usize>,
    /// Largest UDP payload (client and server) of the connection the PUTs and PINGs use.
    #[arg(long, default_value_t = kiln_wire::quic::UDP_PAYLOAD_MAX_BYTES)]
    udp_payload: u16,
    /// Largest UDP payload of each bulk run (client and server), one run per value.
    #[arg(long, value_delimiter = ',', default_values_t = [kiln_wire::quic::UDP_PAYLOAD_MAX_BYTES, 1452])]
    bulk_udp_payloads: Vec<u16>,
    #[arg(long, value_enum, default_value_t = EngineArg::Uring)]
    engine: EngineArg,
    /// Worker threads of the client's tokio runtime; 0 runs the client on a
    /// current-thread runtime on the main thread.
    #[arg(long, default_value_t = 0)]
    client_threads: usize,
    /// Ring workers that run a QUIC endpoint on the shared port (1 = one shared
    /// endpoint); 0 = every worker.
    #[arg(long, default_value_t = 0)]
    endpoints: usize,
    /// Client connections the PUTs are spread over.
    #[arg(long, default_value_t = 1)]
    connections: usize,
}

#[derive(Debug, Args)]
struct MgmtArgs {
    /// Operations measured per phase: CLI sets, store commits, floor samples.
    #[arg(long, default_value_t = 200)]
    sets: usize,
    /// Tasks committing at once in the group-commit run.
    #[arg(long, default_value_t = 16)]
    tasks: usize,
    /// The configuration store under the commits and the daemon: its embedded log, or one
    /// etcd member the run starts in the scratch directory.
    #[arg(long, value_enum, default_value_t = MgmtStore::Embedded)]
    store: MgmtStore,
    /// Do not measure `gluster volume set` (by default it is, where `gluster` and `glusterd`
    /// are installed: glusterd started if none runs, a one-brick volume in the scratch
    /// directory, all torn down after).
    #[arg(long)]
    no_glusterfs: bool,
    /// Also time `kiln --version` and the sets with this `kiln` (the static build of
    /// `scripts/build-static-kiln`), alternating with the one beside kiln-bench.
    #[arg(long)]
    static_kiln: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct MountArgs {
    /// Files of a generated tree (default 80000; giving it or --dirs generates the tree
    /// even when linux-source is installed).
    #[arg(long)]
    files: Option<usize>,
    /// Directories of a generated tree (default 5000).
    #[arg(long)]
    dirs: Option<usize>,
    /// `auto`: Debian's linux-source tarball (/usr/src/linux-source-*.tar.*) when
    /// installed, else a generated tree; `off`: always generate; or a tarball's path.
    #[arg(long, default_value = "auto")]
    linux_source: String,
    /// Seed of the generated tree.
    #[arg(long, default_value_t = mount::DEFAULT_SEED)]
    seed: u64,
    /// Targets to measure (default: local, bindfs, kiln and glusterfs, each where available;
    /// the others are skipped with a note). `kiln-dev-fuse` is Kiln's mount kept on
    /// `/dev/fuse`, against `kiln` on FUSE over io_uring in the same run; `kiln-dist` a
    /// distributed volume of two bricks on the same disk, against `kiln` (one brick).
    #[arg(long, value_enum, value_delimiter = ',')]
    targets: Option<Vec<Target>>,
    /// `-o` options of `kiln mount`, comma-separated (e.g. writeback-cache=on,
    /// attr-timeout-ms=1000).
    #[arg(long, value_delimiter = ',')]
    mount_options: Vec<String>,
    /// `-o` options of bindfs, comma-separated.
    #[arg(long, value_delimiter = ',')]
    bindfs_options: Vec<String>,
    /// An existing GlusterFS volume to mount as the glusterfs target (SERVER:/VOLUME).
    #[arg(long, conflicts_with = "glusterfs_setup")]
    glusterfs_volume: Option<String>,
    /// Set up GlusterFS for the glusterfs target: install Debian's glusterfs-server with
    /// apt-get if missing, start glusterd if none runs, create and start a single-brick
    /// volume in the scratch directory; all torn down after the target.
    #[arg(long)]
    glusterfs_setup: bool,
    /// Files of the repository the git_clone phase clones (the first ones of the tree).
    #[arg(long, default_value_t = mount::DEFAULT_GIT_FILES)]
    git_files: usize,
    /// Mails the maildir phases deliver and read (0 skips them).
    #[arg(long, default_value_t = mail::DEFAULT_MAILS)]
    mails: usize,
    /// Do not drop the kernel's caches before each phase.
    #[arg(long)]
    keep_caches: bool,
    /// Longest run of one phase's command, in seconds.
    #[arg(long, default_value_t = 3600)]
    phase_timeout_s: u64,
}

#[derive(Debug, Args)]
struct SmallfileArgs {
    /// Operations, in order (an op whose precondition is missing gets it set up first,
    /// unmeasured).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = SmallfileOp::SEQUENCE)]
    ops: Vec<SmallfileOp>,
    /// local, engine, volume, kiln-mount or path=DIR; the first is the reference.
    #[arg(long, value_delimiter = ',', default_value = "local,engine,volume")]
    targets: Vec<TargetSpec>,
    /// Workers at once (OS threads on syscall targets, tasks on engine and volume).
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Files per thread.
    #[arg(long, default_value_t = 5000)]
    files: usize,
    #[arg(long, default_value_t = 4096)]
    file_bytes: usize,
    /// The syscall targets' create and append write each file's bytes in write(2)s of this
    /// many (default: one write); the engine and volume targets send them as one fop.
    #[arg(long)]
    record_bytes: Option<usize>,
    /// Files per directory (directories are made as needed).
    #[arg(long, default_value_t = 100)]
    fanout: usize,
    /// fsync every create and append before closing (PUT with O_SYNC on the brick).
    #[arg(long)]
    fsync: bool,
    #[arg(long, default_value_t = smallfile::DEFAULT_SEED)]
    seed: u64,
    /// `-o` options of `kiln mount` for the kiln-mount target.
    #[arg(long, value_delimiter = ',')]
    mount_options: Vec<String>,
    /// KEY=V1,V2,…: run the engine and volume targets once per value of this brick
    /// option (server.event-threads, server.ring-entries, server.engine,
    /// storage.fsync-policy, storage.dirfd-cache-entries, network.inode-lru-limit).
    #[arg(long)]
    vary: Option<String>,
    /// Draw ops/s per op and target into this .svg or .png (may be given again).
    #[arg(long)]
    plot: Vec<PathBuf>,
}

#[derive(Debug, Args)]
struct OpenfdsArgs {
    /// Files held open at each point (the largest the limit allows is always added).
    #[arg(long, value_delimiter = ',', default_values_t = openfds::DEFAULT_HELD)]
    held: Vec<usize>,
    /// Hold at most this many (default: RLIMIT_NOFILE less the brick's headroom).
    #[arg(long)]
    max_held: Option<usize>,
    /// Opens timed at each point.
    #[arg(long, default_value_t = 2000)]
    samples: usize,
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [OpenTarget::Local, OpenTarget::Engine, OpenTarget::Volume])]
    targets: Vec<OpenTarget>,
    /// Draw p50 and p99 against N into this .svg or .png (may be given again).
    #[arg(long)]
    plot: Vec<PathBuf>,
}

#[derive(Debug, Args)]
struct LookupScaleArgs {
    /// Entries (files) on the brick at the end; accepts k and M (2M).
    #[arg(long, value_parser = lookup_scale::parse_count, default_value = "2M")]
    max_entries: usize,
    /// Entry counts to measure at (the maximum is always added).
    #[arg(long, value_parser = lookup_scale::parse_count, value_delimiter = ',',
          default_value = "1k,10k,100k,1M,2M")]
    checkpoints: Vec<usize>,
    /// Random files looked up at each checkpoint, each way.
    #[arg(long, default_value_t = 1000)]
    samples: usize,
    /// Files per directory.
    #[arg(long, default_value_t = 1000)]
    fanout: usize,
    /// MKNODs in flight while filling the brick.
    #[arg(long, default_value_t = 64)]
    depth: usize,
    #[arg(long, default_value_t = lookup_scale::DEFAULT_SEED)]
    seed: u64,
    /// Draw p50 against the entry count into this .svg or .png (may be given again).
    #[arg(long)]
    plot: Vec<PathBuf>,
}

#[derive(Debug, Args)]
struct RebalanceArgs {
    /// Bricks of the volume before one is added (or, with `--remove`, removed).
    #[arg(long, default_value_t = 2)]
    bricks: usize,
    /// Files written before the brick is added (or removed).
    #[arg(long, default_value_t = 10_000)]
    files: usize,
    /// Size of every file, in KiB.
    #[arg(long, default_value_t = 16)]
    file_kib: usize,
    /// Directories the files are spread over.
    #[arg(long, default_value_t = 100)]
    dirs: usize,
    /// Time a brick's removal instead (`remove-brick`: the last brick leaves, and every
    /// file on it moves to the others).
    #[arg(long)]
    remove: bool,
    /// Also measure GlusterFS's rebalance (not available yet: the run says so).
    #[arg(long)]
    glusterfs: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum EngineArg {
    Uring,
    Blocking,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Workload::Mail(args) = &cli.workload {
        // A step of a running benchmark: no scratch, no report.
        return mail::run(args.step, &args.dir, args.mails);
    }
    let scratch = Scratch::new(cli.scratch.as_deref(), cli.loop_fs_mib, cli.loop_fs_inodes)?;
    let mut out = Reporter::new(cli.json);
    print_environment(&cli, &scratch);
    cli.workload.run(&scratch, &mut out)
}

/// The machine and scratch file system, before any result.
fn print_environment(cli: &Cli, scratch: &Scratch) {
    let env = environment(&scratch.fs, cli.workload.seed());
    if cli.json {
        println!("{}", serde_json::json!({ "environment": env }));
    } else {
        println!("# {env}");
        println!(
            "# memory: {} bytes per cached GFID entry, {} bytes per open fd in the table",
            kiln_dataplane::cache::GFID_CACHE_ENTRY_BYTES,
            kiln_dataplane::fdtable::FD_TABLE_ENTRY_BYTES
        );
    }
}

impl Workload {
    /// The seed of a workload that draws its inputs from one.
    fn seed(&self) -> Option<u64> {
        match self {
            Workload::Mount(args) => Some(args.seed),
            Workload::Smallfile(args) => Some(args.seed),
            Workload::LookupScale(args) => Some(args.seed),
            Workload::Rebalance(_) => Some(rebalance::SEED),
            _ => None,
        }
    }

    fn run(self, scratch: &Scratch, out: &mut Reporter) -> anyhow::Result<()> {
        match self {
            Workload::Engine(args) => engine::run(&args.bench(), scratch, out)?,
            Workload::Net(args) => net::run(&args.bench(), scratch, out)?,
            Workload::Mgmt(args) => mgmt::run(&args.bench(), scratch, out)?,
            Workload::Mount(args) => mount::run(&args.bench()?, scratch, out)?,
            Workload::Smallfile(args) => smallfile::run(&args.bench()?, scratch, out)?,
            Workload::Openfds(args) => openfds::run(&args.bench(), scratch, out)?,
            Workload::LookupScale(args) => lookup_scale::run(&args.bench(), scratch, out)?,
            Workload::Rebalance(args) => rebalance::run(&args.bench(), scratch, out)?,
            Workload::Mail(_) => unreachable!("a maildir step runs before any scratch (main)"),
        };
        Ok(())
    }
}

impl EngineArgs {
    fn bench(self) -> EngineBench {
        EngineBench {
            files: self.files,
            dirs: self.dirs.max(1),
            depths: self.depths,
            file_bytes: self.file_bytes,
            open_sweep: self.open_sweep,
            open_samples: self.open_samples,
        }
    }
}

impl NetArgs {
    fn bench(self) -> NetBench {
        NetBench {
            files: self.files,
            dirs: self.dirs.max(1),
            file_bytes: self.file_bytes,
            concurrency: self.concurrency,
            pings: self.pings,
            bulk_mib: self.bulk_mib,
            bulk_inflight: self.bulk_inflight,
            bulk_connections: self.bulk_connections,
            udp_payload: self.udp_payload,
            bulk_udp_payloads: self.bulk_udp_payloads,
            engine: match self.engine {
                EngineArg::Uring => kiln_dataplane::EngineKind::Uring,
                EngineArg::Blocking => kiln_dataplane::EngineKind::Blocking,
            },
            client_threads: self.client_threads,
            endpoints: self.endpoints,
            connections: self.connections,
        }
    }
}

impl MgmtArgs {
    fn bench(self) -> MgmtBench {
        MgmtBench {
            sets: self.sets,
            tasks: self.tasks,
            store: self.store,
            glusterfs: !self.no_glusterfs,
            static_kiln: self.static_kiln,
        }
    }
}

impl MountArgs {
    fn bench(self) -> anyhow::Result<MountBench> {
        Ok(MountBench {
            tree: mount::tree_source(self.files, self.dirs, self.seed, &self.linux_source)?,
            targets: self.targets.unwrap_or_else(|| Target::DEFAULT.to_vec()),
            mount_options: self.mount_options,
            bindfs_options: self.bindfs_options,
            glusterfs_volume: self.glusterfs_volume,
            glusterfs_setup: self.glusterfs_setup,
            git_files: self.git_files.max(1),
            mails: self.mails,
            drop_caches: !self.keep_caches,
            phase_timeout: std::time::Duration::from_secs(self.phase_timeout_s),
        })
    }
}

impl SmallfileArgs {
    fn bench(self) -> anyhow::Result<SmallfileBench> {
        let vary = match self.vary {
            Some(spec) => BrickOption::parse_vary(&spec)?,
            None => Vec::new(),
        };
        Ok(SmallfileBench {
            ops: self.ops,
            targets: self.targets,
            threads: self.threads,
            files: self.files,
            file_bytes: self.file_bytes,
            record_bytes: self.record_bytes,
            fanout: self.fanout,
            fsync: self.fsync,
            seed: self.seed,
            mount_options: self.mount_options,
            vary,
            plots: self.plot,
        })
    }
}

impl OpenfdsArgs {
    fn bench(self) -> OpenfdsBench {
        OpenfdsBench {
            held: self.held,
            max_held: self.max_held,
            samples: self.samples,
            targets: self.targets,
            plots: self.plot,
        }
    }
}

impl LookupScaleArgs {
    fn bench(self) -> LookupScaleBench {
        LookupScaleBench {
            max_entries: self.max_entries,
            checkpoints: self.checkpoints,
            samples: self.samples,
            fanout: self.fanout,
            depth: self.depth,
            seed: self.seed,
            plots: self.plot,
        }
    }
}

impl RebalanceArgs {
    fn bench(self) -> RebalanceBench {
        RebalanceBench {
            bricks: self.bricks,
            files: self.files,
            file_kib: self.file_kib,
            dirs: self.dirs,
            remove: self.remove,
            glusterfs: self.glusterfs,
        }
    }
}
