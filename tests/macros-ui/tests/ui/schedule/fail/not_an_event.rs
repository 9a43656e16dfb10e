// The function must return an event and take the tick: rustc says so at the function.
#[relaybus::schedule(id = "daily", cron = "0 0 9 * * *")]
fn daily(_: relaybus::Tick) -> String {
    String::new()
}

fn main() {}
