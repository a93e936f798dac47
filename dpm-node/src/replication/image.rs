//! Which pool image may be copied over a backup: the identity of an image and the rule a
//! backup applies to the image of a primary that attaches it.
//!
//! A pool's image is named by the primary start it last served under (replica term and
//! instance) and by the replica set's generation: a count, kept with the image, of the
//! backups that left the set while counted for acknowledgements ([`ImageId`]). The
//! generation tells two complete copies of one term apart: a backup removed from the set
//! keeps a consistent but older image, and every write acknowledged after its removal is on
//! the remaining backups, which the primary told the new generation (durably, before the
//! removal took effect). The primary records its image in its pool, so the image travels with
//! every copy of the pool.
//!
//! Invariants:
//! - A backup refuses ([`refusal`]) an image that another primary's writes it accepted may
//!   be missing from: an image of an older term than the one it accepted; of the same term
//!   but another primary start (two primaries took one term: each may have acknowledged
//!   writes the other lacks, so neither overwrites the other without an operator); of the
//!   same term and start but an older generation (the caller's pool left the set before
//!   writes this backup holds were acknowledged).
//! - Generations only grow along a pool's history: a new term keeps the generation of the
//!   image it started from, so comparing generations of one term is meaningful.
//! - Instance 0 is no primary start's (instances are odd): it stands for "unknown" (a pool or
//!   a primary of an older build) and is not compared.
//! - What a backup accepted fences primaries by term ([`Accepted`]); the oldest image it takes
//!   is, by default, that of the start it follows, and a demoted primary or a promoted backup
//!   keeps its own image as the floor while its fence is a later term.

/// The identity of a pool image (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImageId {
    /// The replica term under which the image last served (0: never served).
    pub term: u64,
    /// The primary start that took that term (0: unknown).
    pub instance: u64,
    /// How many counted backups had left the replica set by the image's moment.
    pub generation: u64,
}

impl ImageId {
    /// Bytes of [`ImageId::to_bytes`].
    pub const BYTES: usize = 24;

    /// Term, instance and generation, little-endian.
    pub fn to_bytes(self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..8].copy_from_slice(&self.term.to_le_bytes());
        out[8..16].copy_from_slice(&self.instance.to_le_bytes());
        out[16..].copy_from_slice(&self.generation.to_le_bytes());
        out
    }

    /// Reads [`ImageId::to_bytes`], or the 8-byte term an older build recorded (instance and
    /// generation unknown: 0). `None` for any other length.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        match bytes.len() {
            8 => Some(ImageId {
                term: word(0),
                ..ImageId::default()
            }),
            Self::BYTES => Some(ImageId {
                term: word(0),
                instance: word(8),
                generation: word(16),
            }),
            _ => None,
        }
    }
}

/// What a backup accepted: the primary start it follows (which fences primaries of older
/// terms, and other starts of its term) and the newest generation that primary told it (at
/// the attach, with its copy complete, or when a backup left the set).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accepted {
    pub term: u64,
    /// 0: none in particular (a demoted primary's fence, or a file of an older build): every
    /// primary of `term` is refused.
    pub instance: u64,
    pub generation: u64,
    /// The oldest image it takes, when that is not the one of the start it follows: a demoted
    /// primary's own image, or a promoted backup's copy (whose fence is a later term).
    pub floor: Option<ImageId>,
}

impl Accepted {
    /// The oldest image this backup lets a primary copy over it: its floor, else the image of
    /// the start it follows (that start may have acknowledged writes under its term).
    pub fn image_floor(&self) -> ImageId {
        self.floor.unwrap_or(ImageId {
            term: self.term,
            instance: self.instance,
            generation: self.generation,
        })
    }
}

/// An attaching primary's image as it claims it: an older primary sends only the term, or
/// nothing (`None` fields are not checked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Claim {
    pub term: Option<u64>,
    pub instance: Option<u64>,
    pub generation: Option<u64>,
}

/// Why a backup that accepted `accepted` must refuse a primary whose pool image is `image`
/// (see the module doc), if it must. The caller exempts the primary it accepted and that
/// pool started again.
pub fn refusal(accepted: Accepted, image: Claim) -> Option<Refusal> {
    let accepted = accepted.image_floor();
    let term = image.term?;
    if term < accepted.term {
        return Some(Refusal::OlderTerm {
            image: term,
            accepted: accepted.term,
        });
    }
    if term > accepted.term {
        return None;
    }
    if let Some(instance) = image.instance.filter(|&i| i != 0) {
        if accepted.instance != 0 && instance != accepted.instance {
            return Some(Refusal::RivalStart { term });
        }
    }
    match image.generation {
        Some(g) if g < accepted.generation => Some(Refusal::OlderGeneration {
            term,
            image: g,
            accepted: accepted.generation,
        }),
        _ => None,
    }
}

/// Why an image is refused ([`refusal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Another primary served a later term since the image.
    OlderTerm { image: u64, accepted: u64 },
    /// Two primary starts took `term`; this backup followed the other one.
    RivalStart { term: u64 },
    /// The caller's pool left the replica set (generation `image`) before the writes this
    /// backup holds (generation `accepted`) were acknowledged.
    OlderGeneration {
        term: u64,
        image: u64,
        accepted: u64,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::OlderTerm { image, accepted } => write!(
                f,
                "this backup accepted term {accepted}, newer than term {image} under which the \
                 attaching primary's pool last served"
            ),
            Refusal::RivalStart { term } => write!(
                f,
                "the attaching primary's pool served under another start of term {term} than \
                 the one this backup follows: two primaries took that term, and each may hold \
                 acknowledged writes the other lacks, so neither overwrites the other by \
                 itself; an operator must choose: to let this primary's image replace this \
                 backup's pool, stop this backup and delete its <pool>.term file"
            ),
            Refusal::OlderGeneration {
                term,
                image,
                accepted,
            } => write!(
                f,
                "the attaching primary's pool is of generation {image} of term {term}, but \
                 this backup holds generation {accepted}: the caller's pool left the replica \
                 set (it was removed) before writes this backup holds were acknowledged; \
                 promote a backup that stayed in sync"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepted(term: u64, instance: u64, generation: u64) -> Accepted {
        Accepted {
            term,
            instance,
            generation,
            floor: None,
        }
    }

    fn claim(term: u64, instance: u64, generation: u64) -> Claim {
        Claim {
            term: Some(term),
            instance: Some(instance),
            generation: Some(generation),
        }
    }

    #[test]
    fn the_image_must_be_as_new_as_what_the_backup_accepted() {
        let a = accepted(5, 7, 2);
        assert_eq!(refusal(a, claim(5, 7, 2)), None);
        assert_eq!(refusal(a, claim(5, 7, 3)), None);
        assert_eq!(refusal(a, claim(6, 9, 0)), None, "a later term");
        assert_eq!(
            refusal(a, claim(4, 7, 9)),
            Some(Refusal::OlderTerm {
                image: 4,
                accepted: 5
            })
        );
        assert_eq!(
            refusal(a, claim(5, 7, 1)),
            Some(Refusal::OlderGeneration {
                term: 5,
                image: 1,
                accepted: 2
            }),
            "a backup removed before generation 2"
        );
        assert_eq!(
            refusal(a, claim(5, 11, 2)),
            Some(Refusal::RivalStart { term: 5 }),
            "another start of the same term"
        );
    }

    #[test]
    fn what_is_unknown_is_not_compared() {
        // An older primary: nothing, or only the term.
        assert_eq!(refusal(accepted(5, 7, 2), Claim::default()), None);
        let term_only = Claim {
            term: Some(5),
            ..Claim::default()
        };
        assert_eq!(refusal(accepted(5, 7, 2), term_only), None);
        // A pool of an older build (instance 0), an older build's file (instance 0).
        assert_eq!(refusal(accepted(5, 7, 0), claim(5, 0, 0)), None);
        // A floor replaces the followed start's image: a demoted primary's own.
        let demoted = Accepted {
            floor: Some(ImageId {
                term: 3,
                instance: 9,
                generation: 1,
            }),
            ..accepted(6, 0, 0)
        };
        assert_eq!(refusal(demoted, claim(3, 9, 1)), None);
        assert_eq!(
            refusal(demoted, claim(3, 9, 0)),
            Some(Refusal::OlderGeneration {
                term: 3,
                image: 0,
                accepted: 1
            })
        );
        assert_eq!(refusal(accepted(5, 0, 1), claim(5, 11, 1)), None);
        assert_eq!(
            refusal(accepted(5, 0, 1), claim(5, 11, 0)),
            Some(Refusal::OlderGeneration {
                term: 5,
                image: 0,
                accepted: 1
            })
        );
    }

    #[test]
    fn the_recorded_form_reads_back_and_reads_an_older_builds() {
        let id = ImageId {
            term: 3,
            instance: 0xdead_beef,
            generation: 2,
        };
        assert_eq!(ImageId::from_bytes(&id.to_bytes()), Some(id));
        assert_eq!(
            ImageId::from_bytes(&9u64.to_le_bytes()),
            Some(ImageId {
                term: 9,
                ..ImageId::default()
            })
        );
        assert_eq!(ImageId::from_bytes(&[0u8; 16]), None);
    }
}
