//! Prints the configuration reference that docs/configuration.md embeds:
//! `cargo run -p felix-tuning --example reference`.

fn main() {
    print!("{}", felix_tuning::reference_markdown());
}
