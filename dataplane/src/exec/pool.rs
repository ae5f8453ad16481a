//! A bounded pool of threads for work that blocks: calls io_uring has no opcode for
//! (getdents, chmod/chown/utimes, `l*xattr`, lseek, statvfs) and steps whose opcode this
//! kernel lacks. Shared by the ring workers of a brick.

use tokio::sync::{mpsc, oneshot};

type Job = Box<dyn FnOnce() + Send>;

/// A bounded pool of threads for work that blocks.
#[derive(Debug, Clone)]
pub struct BlockingPool {
    jobs: mpsc::Sender<Job>,
}

impl BlockingPool {
    /// A pool of `threads` threads named `kiln-blocking-<i>` queueing up to `queue_max` jobs.
    pub fn new(threads: usize, queue_max: usize) -> std::io::Result<BlockingPool> {
        BlockingPool::named("kiln-blocking", threads, queue_max)
    }

    pub fn named(name: &str, threads: usize, queue_max: usize) -> std::io::Result<BlockingPool> {
        let (tx, rx) = mpsc::channel::<Job>(queue_max.max(1));
        crate::workers::spawn_queue_threads(name, threads, rx, |job: Job| job())?;
        Ok(BlockingPool { jobs: tx })
    }

    pub async fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(work());
        });
        if self.jobs.send(job).await.is_err() {
            // The pool is gone only at shutdown; nothing can run any more.
            std::process::abort();
        }
        match rx.await {
            Ok(v) => v,
            // The job panicked: surface it in this task as well.
            Err(_) => panic!("a blocking job panicked"),
        }
    }
}
