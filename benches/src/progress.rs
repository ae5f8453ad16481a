//! A progress bar on stderr for the long workloads. It is drawn only when stderr is a
//! terminal, so `--json` output piped to a file, tests and CI logs stay clean; results go to
//! stdout through [`Progress::print`] and [`Progress::note`], which lift the bar out of the
//! way while they print.

use std::io::IsTerminal as _;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};

use crate::report::{Record, Reporter};

/// Progress of one workload: a length in steps and a message saying what runs now.
#[derive(Debug, Clone)]
pub struct Progress {
    bar: ProgressBar,
}

/// How often the bar is redrawn at most.
const REFRESH_HZ: u8 = 8;

impl Progress {
    /// A bar of `len` steps named `workload`; hidden unless stderr is a terminal.
    pub fn new(workload: &str, len: u64) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress::hidden();
        }
        // Cleared when dropped, so an error on the way out leaves no half-drawn bar.
        let bar = ProgressBar::with_draw_target(
            Some(len),
            ProgressDrawTarget::stderr_with_hz(REFRESH_HZ),
        )
        .with_finish(ProgressFinish::AndClear);
        let style = ProgressStyle::with_template(
            "{prefix} {elapsed_precise} [{wide_bar}] {human_pos}/{human_len} {msg} (eta {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        bar.set_style(style);
        bar.set_prefix(workload.to_owned());
        Progress { bar }
    }

    /// A bar that never draws.
    pub fn hidden() -> Progress {
        Progress {
            bar: ProgressBar::hidden(),
        }
    }

    pub fn is_hidden(&self) -> bool {
        self.bar.is_hidden()
    }

    /// Grows the total by `steps` (work found along the way).
    pub fn extend(&self, steps: u64) {
        self.bar.inc_length(steps);
    }

    pub fn inc(&self, steps: u64) {
        self.bar.inc(steps);
    }

    /// What runs now.
    pub fn set_message(&self, message: impl Into<String>) {
        self.bar.set_message(message.into());
    }

    /// Prints a record below the bar.
    pub fn print(&self, out: &mut Reporter, r: &Record) {
        self.bar.suspend(|| out.print(r));
    }

    /// Prints a note below the bar.
    pub fn note(&self, out: &mut Reporter, key: &str, value: &serde_json::Value) {
        self.bar.suspend(|| out.note(key, value));
    }

    /// Removes the bar from the terminal.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
