//! felix-campaign: robustness campaigns against the real `felix` binary over loopback (the
//! crash campaign, the soak, real-disk ENOSPC). Work in progress.
