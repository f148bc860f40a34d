//! Learning-rate schedules with linear warm-up (transformers' conventions).

/// Shape of the learning-rate curve after warmup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    Constant,
    /// Linear decay to 0 at `total_steps`.
    Linear,
    /// Half-cosine decay to `min_lr_ratio * lr` at `total_steps`.
    Cosine {
        min_lr_ratio: f64,
    },
}

/// Learning rate per step: linear warmup from 0 over `warmup_steps`, then the schedule
/// (transformers' `get_*_schedule_with_warmup` conventions).
#[derive(Debug, Clone, PartialEq)]
pub struct LrScheduler {
    pub base_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub schedule: LrSchedule,
}

impl LrScheduler {
    pub fn new(
        base_lr: f64,
        warmup_steps: usize,
        total_steps: usize,
        schedule: LrSchedule,
    ) -> Self {
        Self {
            base_lr,
            warmup_steps,
            total_steps,
            schedule,
        }
    }

    /// Learning rate for (0-based) `step`.
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.base_lr * step as f64 / self.warmup_steps.max(1) as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
        let factor = match self.schedule {
            LrSchedule::Constant => 1.0,
            LrSchedule::Linear => (1.0 - progress).max(0.0),
            LrSchedule::Cosine { min_lr_ratio } => {
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                min_lr_ratio + (1.0 - min_lr_ratio) * cos
            }
        };
        self.base_lr * factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_follow_transformers_conventions() {
        let lin = LrScheduler::new(1.0, 10, 110, LrSchedule::Linear);
        assert_eq!(lin.lr_at(0), 0.0);
        assert!((lin.lr_at(5) - 0.5).abs() < 1e-12);
        assert_eq!(lin.lr_at(10), 1.0);
        assert!((lin.lr_at(60) - 0.5).abs() < 1e-12);
        assert_eq!(lin.lr_at(110), 0.0);
        let cos = LrScheduler::new(2.0, 0, 100, LrSchedule::Cosine { min_lr_ratio: 0.1 });
        assert!((cos.lr_at(0) - 2.0).abs() < 1e-12);
        assert!((cos.lr_at(50) - 2.0 * (0.1 + 0.9 * 0.5)).abs() < 1e-12);
        assert!((cos.lr_at(100) - 0.2).abs() < 1e-12);
        let c = LrScheduler::new(3.0, 2, 10, LrSchedule::Constant);
        assert_eq!(c.lr_at(1), 1.5);
        assert_eq!(c.lr_at(9), 3.0);
    }
}
