//! Key choosers, as in YCSB's `generator` package: zipfian (constant 0.99), scrambled zipfian,
//! uniform, skewed-latest, and the FNV-1a hash YCSB uses to scramble keys.

use rand::Rng;

/// YCSB's zipfian constant.
pub const ZIPFIAN_CONSTANT: f64 = 0.99;
/// The item space YCSB's scrambled zipfian draws from before hashing.
const SCRAMBLED_ITEM_COUNT: u64 = 10_000_000_000;
/// ζ(10^10, 0.99), precomputed by YCSB (`ScrambledZipfianGenerator.ZETAN`).
const SCRAMBLED_ZETAN: f64 = 26.469_028_201_783_02;

/// YCSB's `Utils.fnvhash64`: FNV-1a over the 8 bytes of `value`, as a non-negative `i64`.
pub fn fnv_hash64(value: u64) -> u64 {
    let mut hash: u64 = 0xCBF2_9CE4_8422_2325;
    let mut rest = value;
    for _ in 0..8 {
        hash ^= rest & 0xFF;
        hash = hash.wrapping_mul(1_099_511_628_211);
        rest >>= 8;
    }
    (hash as i64).unsigned_abs()
}

/// ζ(n, θ) = Σ_{i=1..n} 1 / i^θ.
pub fn zeta(count: u64, theta: f64) -> f64 {
    (1..=count)
        .map(|index| 1.0 / (index as f64).powf(theta))
        .sum()
}

/// YCSB's `ZipfianGenerator` (Gray et al., "Quickly generating billion-record synthetic
/// databases"): item `min` is the most popular.
#[derive(Debug, Clone)]
pub struct Zipfian {
    base: u64,
    items: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
}

impl Zipfian {
    /// Items `min..=max` with the given constant.
    pub fn new(min: u64, max: u64, theta: f64) -> Self {
        let items = max - min + 1;
        Self::with_zetan(min, items, theta, zeta(items, theta))
    }

    fn with_zetan(base: u64, items: u64, theta: f64, zetan: f64) -> Self {
        let zeta2 = zeta(2, theta);
        let eta = (1.0 - (2.0 / items as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan);
        Self {
            base,
            items,
            theta,
            alpha: 1.0 / (1.0 - theta),
            zetan,
            eta,
        }
    }

    /// The next item.
    pub fn next(&self, random: &mut impl Rng) -> u64 {
        let uniform: f64 = random.gen();
        let scaled = uniform * self.zetan;
        if scaled < 1.0 {
            return self.base;
        }
        if scaled < 1.0 + 0.5f64.powf(self.theta) {
            return self.base + 1;
        }
        let offset =
            (self.items as f64 * (self.eta * uniform - self.eta + 1.0).powf(self.alpha)) as u64;
        self.base + offset.min(self.items - 1)
    }

    /// The probability of the most popular item, 1/ζ(n, θ).
    pub fn top_probability(&self) -> f64 {
        1.0 / self.zetan
    }
}

/// How requests pick their keys.
#[derive(Debug, Clone)]
pub enum KeyChooser {
    /// Every key equally likely.
    Uniform,
    /// YCSB's scrambled zipfian: popular keys spread over the key space.
    ScrambledZipfian(Zipfian),
    /// YCSB's skewed-latest: the most recently inserted keys are the most popular.
    Latest,
}

impl KeyChooser {
    /// The chooser for a `requestdistribution` value.
    ///
    /// # Errors
    /// A message listing the supported distributions.
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "uniform" => Ok(Self::Uniform),
            "zipfian" => Ok(Self::ScrambledZipfian(Zipfian::with_zetan(
                0,
                SCRAMBLED_ITEM_COUNT,
                ZIPFIAN_CONSTANT,
                SCRAMBLED_ZETAN,
            ))),
            "latest" => Ok(Self::Latest),
            other => Err(format!(
                "requestdistribution `{other}` is not supported: use zipfian, uniform or latest"
            )),
        }
    }

    /// A key number in `0..record_count` (the records inserted so far).
    pub fn next(&self, record_count: u64, random: &mut impl Rng) -> u64 {
        let count = record_count.max(1);
        match self {
            Self::Uniform => random.gen_range(0..count),
            Self::ScrambledZipfian(zipfian) => fnv_hash64(zipfian.next(random)) % count,
            Self::Latest => {
                let zipfian = Zipfian::with_zetan(0, count, ZIPFIAN_CONSTANT, zeta_cached(count));
                count - 1 - zipfian.next(random).min(count - 1)
            }
        }
    }
}

/// ζ(n, 0.99) for the latest chooser, whose n grows with every insert: computed incrementally
/// and cached per thread.
fn zeta_cached(count: u64) -> f64 {
    thread_local! {
        static CACHE: std::cell::Cell<(u64, f64)> = const { std::cell::Cell::new((0, 0.0)) };
    }
    CACHE.with(|cache| {
        let (mut known, mut sum) = cache.get();
        if count < known {
            known = 0;
            sum = 0.0;
        }
        for index in known + 1..=count {
            sum += 1.0 / (index as f64).powf(ZIPFIAN_CONSTANT);
        }
        cache.set((count, sum));
        sum
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn fnv_scrambles_neighbours_and_stays_non_negative() {
        let hashes: Vec<u64> = (0..1000u64).map(fnv_hash64).collect();
        assert!(hashes.iter().all(|hash| *hash <= i64::MAX as u64));
        let mut unique = hashes.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), 1000, "no collisions among 1000 neighbours");
        assert!(
            hashes.windows(2).filter(|pair| pair[0] < pair[1]).count() < 700,
            "not monotonic"
        );
    }

    #[test]
    fn zipfian_top_key_frequency_matches_theory() {
        let zipfian = Zipfian::new(0, 999, ZIPFIAN_CONSTANT);
        let mut random = rand::rngs::StdRng::seed_from_u64(7);
        let samples = 1_000_000;
        let mut top = 0u64;
        let mut second = 0u64;
        for _ in 0..samples {
            match zipfian.next(&mut random) {
                0 => top += 1,
                1 => second += 1,
                _ => {}
            }
        }
        let expected_top = zipfian.top_probability();
        let observed_top = top as f64 / samples as f64;
        assert!(
            (observed_top - expected_top).abs() / expected_top < 0.03,
            "top key frequency {observed_top:.4}, theory {expected_top:.4}"
        );
        let expected_second = expected_top / 2f64.powf(ZIPFIAN_CONSTANT);
        let observed_second = second as f64 / samples as f64;
        assert!(
            (observed_second - expected_second).abs() / expected_second < 0.05,
            "second key frequency {observed_second:.4}, theory {expected_second:.4}"
        );
    }

    #[test]
    fn choosers_stay_in_range_and_latest_prefers_new_keys() {
        let mut random = rand::rngs::StdRng::seed_from_u64(1);
        for name in ["uniform", "zipfian", "latest"] {
            let chooser = KeyChooser::from_name(name).expect("known");
            for _ in 0..10_000 {
                assert!(chooser.next(500, &mut random) < 500);
            }
        }
        let latest = KeyChooser::from_name("latest").expect("known");
        let newest = (0..10_000)
            .filter(|_| latest.next(1_000, &mut random) == 999)
            .count();
        assert!(
            newest > 1_000,
            "the newest key is the most popular: {newest}"
        );
        assert!(KeyChooser::from_name("hotspot")
            .unwrap_err()
            .contains("zipfian, uniform or latest"));
    }
}
