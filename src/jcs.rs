//! Canonical JSON (RFC 8785, JCS) of a `serde_json::Value`, written straight
//! to a writer: a hasher takes a long conversation's canonical bytes with
//! no copy of it and no buffer.
//!
//! The bytes are those of `serde_json_canonicalizer` (a property test pins
//! it), which buffers and sorts every object's members as it goes and so
//! spends most of its time allocating. Here an object's members are written
//! in the map's own order when that is already the canonical one (keys
//! sorted by UTF-16 code units: byte order, unless a key holds a character
//! at U+E000 or above), strings are escaped as serde_json escapes them
//! (JCS's rules), and integers within 2^53 are written as they are; other
//! numbers (floats, larger integers, which JCS writes as doubles) are left
//! to the canonicalizer.

use std::cmp::Ordering;
use std::io::{self, Write};

use serde_json::{Map, Number, Value};

/// Integers up to this magnitude are written as they are.
const EXACT: u64 = (1 << 53) - 1;

/// Writes `value`'s canonical JSON to `out`.
pub fn write<W: Write>(value: &Value, out: &mut W) -> io::Result<()> {
    match value {
        Value::Null => out.write_all(b"null"),
        Value::Bool(true) => out.write_all(b"true"),
        Value::Bool(false) => out.write_all(b"false"),
        Value::Number(n) => number(n, out),
        Value::String(s) => string(s, out),
        Value::Array(items) => {
            out.write_all(b"[")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write(item, out)?;
            }
            out.write_all(b"]")
        }
        Value::Object(map) => write_object(map, out),
    }
}

/// Writes an object's canonical JSON to `out`.
pub fn write_object<W: Write>(map: &Map<String, Value>, out: &mut W) -> io::Result<()> {
    let mut members: Vec<(&String, &Value)> = map.iter().collect();
    if !members.is_sorted_by(|a, b| key_order(a.0, b.0).is_le()) {
        members.sort_by(|a, b| key_order(a.0, b.0));
    }
    out.write_all(b"{")?;
    for (i, (key, value)) in members.into_iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        string(key, out)?;
        out.write_all(b":")?;
        write(value, out)?;
    }
    out.write_all(b"}")
}

/// `value`'s canonical JSON.
pub fn to_vec(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write(value, &mut out).expect("writing to a Vec cannot fail");
    out
}

/// JCS orders keys by their UTF-16 code units.
fn key_order(a: &str, b: &str) -> Ordering {
    // Byte order is code point order, which is UTF-16 order unless a
    // surrogate pair meets a character of U+E000..=U+FFFF.
    let plain = |s: &str| s.bytes().all(|b| b < 0xEE);
    match plain(a) && plain(b) {
        true => a.cmp(b),
        false => a.encode_utf16().cmp(b.encode_utf16()),
    }
}

fn string<W: Write>(s: &str, out: &mut W) -> io::Result<()> {
    // serde_json escapes `"`, `\` and control characters (`\b \t \n \f \r`,
    // the others as lowercase `\u00xx`) and nothing else: JCS's rules.
    serde_json::to_writer(out, s).map_err(io::Error::other)
}

fn number<W: Write>(n: &Number, out: &mut W) -> io::Result<()> {
    if let Some(u) = n.as_u64().filter(|u| *u <= EXACT) {
        return write!(out, "{u}");
    }
    if let Some(i) = n.as_i64().filter(|i| i.unsigned_abs() <= EXACT) {
        return write!(out, "{i}");
    }
    serde_json_canonicalizer::to_writer(n, out).map_err(io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn reference(v: &Value) -> Vec<u8> {
        serde_json_canonicalizer::to_vec(v).unwrap()
    }

    // The RFC's own example numbers, as it spells them.
    #[allow(clippy::excessive_precision)]
    #[test]
    fn the_rfc_8785_examples_and_the_edges_are_written_as_the_canonicalizer_writes_them() {
        let cases = [
            json!({"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
                   "string": "\u{20ac}$\u{000F}\u{000a}A'\u{0042}\u{0022}\u{005c}\\\"/",
                   "literals": [null, true, false]}),
            json!({"\u{20ac}": "Euro Sign", "\r": "Carriage Return", "\u{fb33}": "Hebrew Letter Dalet With Dagesh",
                   "1": "One", "\u{1f600}": "Emoji: Grinning Face", "\u{0080}": "Control", "\u{00f6}": "Latin Small Letter O With Diaeresis"}),
            json!([
                9007199254740991u64,
                9007199254740992u64,
                -9007199254740991i64,
                -9007199254740993i64,
                u64::MAX,
                i64::MIN,
                0,
                -0.0,
                1.0,
                100,
                1e21,
                1e-7,
                "\u{7f}\u{1}"
            ]),
        ];
        for v in cases {
            assert_eq!(
                String::from_utf8(to_vec(&v)).unwrap(),
                String::from_utf8(reference(&v)).unwrap()
            );
        }
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z_]{0,6}",
            "[\u{0}-\u{7f}]{0,3}",
            "[a\u{e000}-\u{e002}\u{ff00}\u{10000}-\u{10002}\u{1f600}é]{0,3}",
        ]
    }

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-(1i64 << 53)..(1i64 << 53)).prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            "\\PC{0,8}".prop_map(Value::String),
            "[\u{0}-\u{1f}\"\\\\/\u{7f}\u{2028}]{0,4}".prop_map(Value::String),
        ]
    }

    fn value() -> impl Strategy<Value = Value> {
        leaf().prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((key(), inner), 0..6)
                    .prop_map(|members| Value::Object(members.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn any_value_is_written_as_the_canonicalizer_writes_it(v in value()) {
            prop_assert_eq!(to_vec(&v), reference(&v));
        }
    }
}
