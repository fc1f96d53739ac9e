//! The kernel's CPU list format (`0-3,8,10-11`), read from sysfs and from FELIX_DATAPLANE_CORES.

/// Largest CPU index this crate accepts anywhere.
///
/// Chosen as the last index a `cpu_set_t` holds (glibc's CPU_SETSIZE is 1024), because every
/// CPU we plan for is eventually pinned through `sched_setaffinity` with such a set. It also
/// bounds how far a range like `0-4000000000` in user input can expand.
pub const CPU_INDEX_MAX: usize = 1023;

const _: () = assert!(CPU_INDEX_MAX + 1 == nix::sched::CpuSet::count());

/// Parses a CPU list into ascending CPU indices.
///
/// An empty (or all-whitespace) string is an empty list: sysfs writes that for a NUMA node
/// without CPUs. A CPU named twice, a reversed range or an index above [`CPU_INDEX_MAX`] is
/// an error, described in words for the caller to wrap.
pub fn parse_cpu_list(text: &str) -> Result<Vec<usize>, String> {
    let text = text.trim();
    let mut cpus = Vec::new();
    if text.is_empty() {
        return Ok(cpus);
    }
    for item in text.split(',') {
        let item = item.trim();
        let (first, last) = match item.split_once('-') {
            Some((a, b)) => (parse_index(a)?, parse_index(b)?),
            None => {
                let cpu = parse_index(item)?;
                (cpu, cpu)
            }
        };
        if first > last {
            return Err(format!("range {item:?} runs backwards"));
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    if let Some(pair) = cpus.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(format!("CPU {} is listed twice", pair[0]));
    }
    debug_assert!(cpus.iter().all(|&cpu| cpu <= CPU_INDEX_MAX));
    Ok(cpus)
}

fn parse_index(text: &str) -> Result<usize, String> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{text:?} is not a CPU number"));
    }
    match text.parse::<usize>() {
        Ok(cpu) if cpu <= CPU_INDEX_MAX => Ok(cpu),
        _ => Err(format!(
            "CPU {text} is above the largest supported index {CPU_INDEX_MAX}"
        )),
    }
}

/// Formats ascending CPU indices the way the kernel does (`0-3,8`); `none` when empty.
pub fn format_cpu_list(cpus: &[usize]) -> String {
    if cpus.is_empty() {
        return "none".to_string();
    }
    debug_assert!(cpus.windows(2).all(|pair| pair[0] < pair[1]));
    let mut parts = Vec::new();
    let mut start = cpus[0];
    let mut end = cpus[0];
    for &cpu in &cpus[1..] {
        if cpu == end + 1 {
            end = cpu;
        } else {
            parts.push(range_text(start, end));
            start = cpu;
            end = cpu;
        }
    }
    parts.push(range_text(start, end));
    parts.join(",")
}

fn range_text(start: usize, end: usize) -> String {
    if start == end {
        start.to_string()
    } else {
        format!("{start}-{end}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_singles_and_ranges_in_order() {
        // Proves the kernel list format is read into sorted indices, whitespace tolerated.
        assert_eq!(parse_cpu_list("0-3,8\n"), Ok(vec![0, 1, 2, 3, 8]));
        assert_eq!(parse_cpu_list("5, 1-2"), Ok(vec![1, 2, 5]));
        assert_eq!(parse_cpu_list("7-7"), Ok(vec![7]));
        assert_eq!(parse_cpu_list(" \n"), Ok(vec![]));
    }

    #[test]
    fn rejects_garbage_duplicates_and_huge_indices() {
        // Proves bad lists are refused instead of guessed at, and ranges cannot blow up.
        for bad in [
            "a",
            "1-",
            "-1",
            "1,,2",
            "3-1",
            "1,1",
            "0-2,2",
            "+1",
            "1024",
            "0-99999999999",
        ] {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn formats_like_the_kernel() {
        // Proves formatting compresses runs and round-trips through the parser.
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpu_list(&[4]), "4");
        assert_eq!(format_cpu_list(&[]), "none");
        let cpus = vec![0, 2, 3, 4, 9];
        assert_eq!(parse_cpu_list(&format_cpu_list(&cpus)), Ok(cpus));
    }
}
