//! How the binaries (`agentrun`, `kubectl agentrun`) end on an error: one
//! line on stderr, the error and its causes joined (`{:#}`), and a non-zero
//! exit code. Never the `Debug` form `fn main() -> Result` prints, which adds
//! a backtrace whenever `RUST_BACKTRACE` is set: a person reads this line.

use std::io::Write;
use std::process::ExitCode;

/// Prints `result`'s error (if any) to stderr as [`line`] and turns it into
/// the process's exit code.
pub fn code(program: &str, result: anyhow::Result<()>) -> ExitCode {
    report(program, result, &mut std::io::stderr().lock())
}

/// [`code`], writing to `out`.
pub fn report(program: &str, result: anyhow::Result<()>, out: &mut impl Write) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(out, "{}", line(program, &e));
            ExitCode::FAILURE
        }
    }
}

/// `PROGRAM: error: cause: its cause`, on one line: line breaks inside a
/// message (an API server's body, say) become spaces.
pub fn line(program: &str, e: &anyhow::Error) -> String {
    let joined = format!("{e:#}");
    let flat: Vec<&str> = joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    format!("{program}: error: {}", flat.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    fn failed() -> anyhow::Result<()> {
        Err(anyhow::anyhow!(
            "no ConfigMap agentrun-system/agentrun-controller-keys\n(forbidden)"
        ))
        .context("reading the controller's keys")
    }

    #[test]
    fn an_error_is_one_line_with_its_causes_and_no_backtrace() {
        // The Display form never holds the backtrace anyhow may have
        // captured (RUST_BACKTRACE): the exact line is all there is.
        let mut out = Vec::new();
        let code = report("kubectl-agentrun", failed(), &mut out);
        assert_eq!(code, ExitCode::FAILURE);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "kubectl-agentrun: error: reading the controller's keys: \
             no ConfigMap agentrun-system/agentrun-controller-keys (forbidden)\n"
        );
    }

    #[test]
    fn success_prints_nothing() {
        let mut out = Vec::new();
        assert_eq!(report("agentrun", Ok(()), &mut out), ExitCode::SUCCESS);
        assert!(out.is_empty());
    }
}
