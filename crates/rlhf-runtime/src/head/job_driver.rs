//! What the job manager reads off a driver: whether its process is still the job's driver,
//! signals to its process group, the tail of its log and its last `error:` line; and job ids
//! and UTC times as `rlhf-head` prints them.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

/// Formats milliseconds since the epoch as `YYYY-MM-DD HH:MM:SS` (UTC).
pub fn fmt_utc_ms(ms: i64) -> String {
    let (y, mo, d, h, mi, s) = utc_parts(ms);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}")
}

pub(super) fn utc_parts(ms: i64) -> (i64, u32, u32, u32, u32, u32) {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400) as u32;
    // Days since 1970-01-01 to a proleptic Gregorian date, counting eras of 400 years
    // from 0000-03-01 so the leap day falls at the end of each year.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, sod / 3600, sod / 60 % 60, sod % 60)
}

pub(super) fn new_job_id(now_ms: i64) -> String {
    let (y, mo, d, h, mi, s) = utc_parts(now_ms);
    let u = uuid::Uuid::new_v4().simple().to_string();
    format!("job-{y:04}{mo:02}{d:02}-{h:02}{mi:02}{s:02}-{}", &u[..4])
}

/// The text after the last line of `log` that starts with `error:`.
pub fn last_error_line(log: &str) -> Option<String> {
    log.lines()
        .rev()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("error:"))
        .map(|e| e.trim().to_string())
}

pub(crate) fn read_tail(path: &Path, bytes: u64) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(bytes)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

pub(crate) fn last_nonempty_line(path: &Path) -> Option<String> {
    read_tail(path, 16 * 1024)
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
}

/// Whether `pid` is still the driver of `job_id` (not a process that reused the pid).
pub(super) fn driver_alive(pid: i32, job_id: &str) -> bool {
    if pid <= 0 {
        return false;
    }
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(c) => crate::process_alive(pid as u32) && String::from_utf8_lossy(&c).contains(job_id),
        Err(_) => false,
    }
}

pub(super) fn signal_group(pid: i32, sig: Signal) {
    if pid > 0 {
        // The driver leads its own group, so this reaches the processes it started too.
        let _ = signal::killpg(Pid::from_raw(pid), sig);
    }
}
