//! Hexadecimal text for binary keys and values: two digits per byte, lowercase on output, either
//! case (and an optional `0x`) on input.

use anyhow::bail;

/// The bytes' hexadecimal digits, lowercase, two per byte, no prefix (what `xxd -p -r` reads).
pub fn encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        text.push(char::from(DIGITS[usize::from(byte >> 4)]));
        text.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    text
}

/// The bytes that `text` spells, two hexadecimal digits per byte, after an optional `0x`.
///
/// # Errors
/// When `text` has an odd number of digits or a character that is not a hexadecimal digit.
pub fn decode(text: &str) -> anyhow::Result<Vec<u8>> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    if let Some((position, character)) = digits
        .char_indices()
        .find(|(_, character)| !character.is_ascii_hexdigit())
    {
        bail!("`{text}` is not hexadecimal: {character:?} at character {position}");
    }
    if digits.len() % 2 != 0 {
        bail!(
            "`{text}` has an odd number of hexadecimal digits ({}): two per byte",
            digits.len()
        );
    }
    Ok(digits
        .as_bytes()
        .chunks_exact(2)
        .map(|pair| (digit_value(pair[0]) << 4) | digit_value(pair[1]))
        .collect())
}

/// The value of one ASCII hexadecimal digit (checked by the caller).
fn digit_value(digit: u8) -> u8 {
    match digit {
        b'0'..=b'9' => digit - b'0',
        b'a'..=b'f' => digit - b'a' + 10,
        b'A'..=b'F' => digit - b'A' + 10,
        _ => unreachable!("digits are checked before they are decoded"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_byte() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(decode(&encode(&bytes)).expect("decode"), bytes);
    }

    #[test]
    fn accepts_either_case_and_a_prefix() {
        assert_eq!(decode("00fF").expect("decode"), [0x00, 0xff]);
        assert_eq!(decode("0xAb01").expect("decode"), [0xab, 0x01]);
        assert_eq!(decode("").expect("decode"), Vec::<u8>::new());
    }

    #[test]
    fn refuses_odd_lengths_and_other_characters() {
        assert!(decode("abc").is_err());
        let error = decode("12zz").expect_err("not hex").to_string();
        assert!(error.contains("'z' at character 2"), "{error}");
        assert!(decode("é0").is_err());
    }
}
