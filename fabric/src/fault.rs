//! Fault injection for tests: a wrapper that delays, fails, or tears the WRITE of a post after
//! k bytes, over any backend. A torn post applies the operations before the torn WRITE, the
//! first k bytes of that WRITE, and nothing after it, then reports an error, which is what a
//! caller sees when its connection (or its process) dies in the middle of an RDMA WRITE.

use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use crate::error::{FabricError, Result};
use crate::op::{Completion, Op};
use crate::stats::FabricStats;
use crate::Fabric;

/// What the wrapper does to the next posts.
#[derive(Debug, Default, Clone)]
pub struct FaultPlan {
    /// Sleep this long before every post.
    pub delay: Option<Duration>,
    /// Fail this many next posts without applying anything.
    pub fail_next: u32,
    /// Tear the first WRITE of the next post that has one after this many bytes.
    pub tear_next_write_after: Option<usize>,
}

/// A backend wrapped with a fault plan.
#[derive(Debug)]
pub struct Faulty<F> {
    inner: F,
    plan: Mutex<FaultPlan>,
}

impl<F: Fabric> Faulty<F> {
    pub fn new(inner: F) -> Self {
        Faulty {
            inner,
            plan: Mutex::new(FaultPlan::default()),
        }
    }

    pub fn set_plan(&self, plan: FaultPlan) {
        *self.plan.lock() = plan;
    }

    /// The plan as it stands (a tear that has happened is no longer in it).
    pub fn plan(&self) -> FaultPlan {
        self.plan.lock().clone()
    }

    pub fn inner(&self) -> &F {
        &self.inner
    }
}

#[async_trait]
impl<F: Fabric> Fabric for Faulty<F> {
    async fn post(&self, ops: &[Op]) -> Result<Vec<Completion>> {
        let (delay, fail, tear) = {
            let mut p = self.plan.lock();
            let fail = p.fail_next > 0;
            if fail {
                p.fail_next -= 1;
            }
            let has_write = ops.iter().any(|o| matches!(o, Op::Write { .. }));
            let tear = if !fail && has_write {
                p.tear_next_write_after.take()
            } else {
                None
            };
            (p.delay, fail, tear)
        };
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        if fail {
            return Err(FabricError::Injected("post failed"));
        }
        let Some(k) = tear else {
            return self.inner.post(ops).await;
        };
        let at = ops
            .iter()
            .position(|o| matches!(o, Op::Write { .. }))
            .expect("checked above");
        let mut torn: Vec<Op> = ops[..at].to_vec();
        if let Op::Write { offset, data } = &ops[at] {
            let k = k.min(data.len());
            if k > 0 {
                torn.push(Op::Write {
                    offset: *offset,
                    data: data.slice(..k),
                });
            }
        }
        if !torn.is_empty() {
            self.inner.post(&torn).await?;
        }
        Err(FabricError::Injected("write torn"))
    }

    fn stats(&self) -> &FabricStats {
        self.inner.stats()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
}
