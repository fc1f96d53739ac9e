//! The clock-synchronization check: asks the kernel (adjtimex) whether NTP discipline is on.

use super::{Check, Outcome};

/// Whether the kernel considers the system clock synchronized, via `adjtimex(2)` with no
/// modes (read-only). Fail when it returns TIME_ERROR or the status has STA_UNSYNC (no time
/// daemon is disciplining the clock: run chrony or systemd-timesyncd); Pass otherwise, with the
/// kernel's estimated and maximum error; Skip when the call itself fails.
pub fn clock_sync() -> Check {
    // SAFETY: timex is plain data; all-zero (modes 0: read only) is a valid argument.
    let mut timex: libc::timex = unsafe { std::mem::zeroed() };
    // SAFETY: `timex` is a live, writable timex.
    let state = unsafe { libc::adjtimex(&mut timex) };
    if state < 0 {
        return Check::new(
            "clock sync",
            Outcome::Skip,
            format!("adjtimex failed: {}", std::io::Error::last_os_error()),
        );
    }
    clock_outcome(state, timex.status, timex.esterror, timex.maxerror)
}

/// The check from adjtimex's return value, status bits and error estimates (microseconds).
fn clock_outcome(
    state: libc::c_int,
    status: libc::c_int,
    esterror: libc::c_long,
    maxerror: libc::c_long,
) -> Check {
    if state == libc::TIME_ERROR || status & libc::STA_UNSYNC != 0 {
        Check::new(
            "clock sync",
            Outcome::Fail,
            "the clock is not synchronized (NTP): run chrony or systemd-timesyncd",
        )
    } else {
        Check::new(
            "clock sync",
            Outcome::Pass,
            format!("synchronized, estimated error {esterror} us, maximum error {maxerror} us"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_sync_runs() {
        let check = clock_sync();
        eprintln!("{check:?}");
        assert_eq!(check.name, "clock sync");
    }

    #[test]
    fn outcomes() {
        assert_eq!(
            clock_outcome(libc::TIME_OK, 0, 10, 20).outcome,
            Outcome::Pass
        );
        assert_eq!(
            clock_outcome(libc::TIME_ERROR, 0, 0, 0).outcome,
            Outcome::Fail
        );
        assert_eq!(
            clock_outcome(libc::TIME_OK, libc::STA_UNSYNC, 0, 0).outcome,
            Outcome::Fail
        );
    }
}
