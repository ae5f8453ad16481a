//! Child processes the workloads start: waiting on them with a bound, and quoting their logs.

use std::io::Read as _;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::Context;
use rustix::process::{Pid, PidfdFlags};

/// Bytes of a log quoted in an error.
const LOG_TAIL_BYTES: u64 = 2048;
/// Longest single poll before `give_up` is asked again.
const WAIT_SLICE: Duration = Duration::from_millis(100);

pub fn pid_of(child: &Child) -> anyhow::Result<Pid> {
    i32::try_from(child.id())
        .ok()
        .and_then(Pid::from_raw)
        .context("child process id")
}

/// Waits until `child` exits (without reaping it) or `timeout` passes; true if it exited.
/// Gives up early (false) once `give_up` says so (a run being stopped).
pub fn wait_exit(
    child: &Child,
    timeout: Duration,
    give_up: impl Fn() -> bool,
) -> anyhow::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let pidfd =
        rustix::process::pidfd_open(pid_of(child)?, PidfdFlags::empty()).context("pidfd_open")?;
    let deadline = Instant::now() + timeout;
    loop {
        if give_up() {
            return Ok(false);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let slice = Timespec::try_from(left.min(WAIT_SLICE))?;
        let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&slice)) {
            Ok(0) if left.is_zero() => return Ok(false),
            // Time left, or a signal: poll again.
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => return Ok(true),
            Err(e) => return Err(e).context("poll on a pidfd"),
        }
    }
}

/// The last bytes of a log file, for an error message.
pub fn log_tail(path: &Path) -> String {
    use std::io::{Seek as _, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut bytes = Vec::new();
    let _ = file.take(LOG_TAIL_BYTES).read_to_end(&mut bytes);
    String::from_utf8_lossy(&bytes).trim().to_owned()
}
