//! The brick's worker threads: each one a tokio current-thread runtime with a `LocalSet`, its
//! own per-thread context (`C`: the engine's ring and fops on that thread), and a bounded queue
//! of jobs run there. The engine runs its fops on them and the QUIC server its endpoints, so a
//! connection's fops run on the thread that reads its packets, with no hop in between.
//!
//! This is the one module that makes the brick's threads and runtimes.

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

/// A job run on a worker thread with that worker's context. It may spawn local tasks there.
pub type Job<C> = Box<dyn FnOnce(&C) + Send>;

/// The worker threads. Cheap to clone; the threads stop when every clone is gone (their
/// queues close) and their local tasks have ended.
#[derive(Debug)]
pub struct Workers<C> {
    queues: Arc<[mpsc::Sender<Job<C>>]>,
}

impl<C> Clone for Workers<C> {
    fn clone(&self) -> Self {
        Workers {
            queues: self.queues.clone(),
        }
    }
}

/// A worker is gone (its thread ended): the brick is shutting down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the worker thread is gone")]
pub struct WorkerGone;

impl<C: 'static> Workers<C> {
    /// Starts `count` threads named `<name>-<i>`, each queueing up to `queue_max` jobs; `init`
    /// makes each thread's context on that thread, inside its runtime. Fails if any thread
    /// cannot start or its `init` fails.
    pub fn start(
        name: &str,
        count: usize,
        queue_max: usize,
        init: impl Fn(usize) -> std::io::Result<C> + Send + Clone + 'static,
    ) -> std::io::Result<Workers<C>> {
        let mut queues = Vec::with_capacity(count.max(1));
        for i in 0..count.max(1) {
            let (tx, rx) = mpsc::channel(queue_max.max(1));
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            let init = init.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || run_worker(i, init, rx, ready_tx))?;
            ready_rx
                .recv()
                .map_err(|_| std::io::Error::other("worker thread died at start"))??;
            queues.push(tx);
        }
        Ok(Workers {
            queues: queues.into(),
        })
    }

    pub fn len(&self) -> usize {
        self.queues.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }

    /// Runs `job` on worker `worker` (modulo the count), waiting for room in its queue.
    pub async fn send(
        &self,
        worker: usize,
        job: impl FnOnce(&C) + Send + 'static,
    ) -> Result<(), WorkerGone> {
        self.queue(worker)
            .send(Box::new(job))
            .await
            .map_err(|_| WorkerGone)
    }

    /// Like [`Workers::send`] but never waits: when the queue is full a helper thread waits
    /// for room (for drops, which cannot await and must not lose their job).
    pub fn send_detached(&self, worker: usize, job: impl FnOnce(&C) + Send + 'static) {
        let queue = self.queue(worker).clone();
        if let Err(mpsc::error::TrySendError::Full(job)) = queue.try_send(Box::new(job)) {
            std::thread::spawn(move || {
                let _ = queue.blocking_send(job);
            });
        }
    }

    fn queue(&self, worker: usize) -> &mpsc::Sender<Job<C>> {
        &self.queues[worker % self.queues.len()]
    }
}

/// One worker thread: its runtime, its context, then jobs until the queue closes (every
/// handle is gone); tasks still running then are dropped with the thread.
fn run_worker<C: 'static>(
    index: usize,
    init: impl Fn(usize) -> std::io::Result<C>,
    queue: mpsc::Receiver<Job<C>>,
    ready: std::sync::mpsc::Sender<std::io::Result<()>>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let context = match init(index) {
            Ok(context) => context,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        let mut queue = queue;
        while let Some(job) = queue.recv().await {
            job(&context);
        }
    });
}

/// Starts `threads` plain threads named `<name>-<i>` that share one bounded queue, each running
/// `handle` on the items it takes, until every sender is gone: the blocking pools.
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
