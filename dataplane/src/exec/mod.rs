//! Executors: how a chain of [`Step`]s reaches the kernel. The fop logic (`fops.rs`) is written
//! once against [`Exec`]; [`blocking::BlockingExec`] makes one syscall per step on the calling
//! thread, [`uring::UringExec`] turns a chain into linked SQEs submitted with the other fops of
//! the same loop turn.

pub mod blocking;
pub mod uring;

use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use crate::step::{Step, StepResult};

/// Runs chains of steps and blocking work.
pub trait Exec {
    /// Runs `steps` in order as one chain. A failed step cancels the ones after it, which
    /// report `ECANCELED`; the result has one entry per step.
    fn run(&self, steps: Vec<Step>) -> impl Future<Output = Vec<StepResult>>;

    /// Runs `work` where blocking is allowed: calls that have no io_uring opcode (getdents,
    /// chmod/chown/utimes, listxattr, …).
    fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> impl Future<Output = T>;
}

/// Starts `threads` threads named `<name>-<i>` that share one bounded queue, each running
/// `handle` on the items it takes, until every sender is gone: the shape of both the blocking
/// pool and the blocking engine.
pub(crate) fn spawn_queue_threads<T: Send + 'static>(
    name: &str,
    threads: usize,
    queue: mpsc::Receiver<T>,
    handle: impl Fn(T) + Send + Clone + 'static,
) -> std::io::Result<()> {
    let queue = Arc::new(Mutex::new(queue));
    for i in 0..threads.max(1) {
        let (queue, handle) = (queue.clone(), handle.clone());
        std::thread::Builder::new()
            .name(format!("{name}-{i}"))
            .spawn(move || {
                loop {
                    let item = queue
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .blocking_recv();
                    match item {
                        Some(item) => handle(item),
                        None => return,
                    }
                }
            })?;
    }
    Ok(())
}
