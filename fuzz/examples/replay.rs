//! Replays inputs through a harness without libFuzzer (a plain build, with a debugger or
//! `FELIX_FUZZ_TRACE=1` for the core target's step log):
//! `cargo run --manifest-path fuzz/Cargo.toml --example replay -- core FILE...`

fn main() {
    let mut args = std::env::args().skip(1);
    let target = args
        .next()
        .expect("usage: replay decode|core|recovery FILE...");
    let run: fn(&[u8]) = match target.as_str() {
        "decode" => felix_fuzz::decode::run,
        "core" => felix_fuzz::machine::run,
        "recovery" => felix_fuzz::recovery::run,
        other => panic!("unknown target {other:?} (decode, core, recovery)"),
    };
    for path in args {
        let data = std::fs::read(&path).unwrap_or_else(|error| panic!("{path}: {error}"));
        eprintln!("replay {target} {path} ({} bytes)", data.len());
        run(&data);
    }
    eprintln!("replay: done");
}
