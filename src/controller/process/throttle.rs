//! A token bucket in front of the controller's API client (`--api-qps`,
//! `--api-burst`), as client-go has: a burst of reconciles after a restart
//! or a resync cannot flood the API server. The client's buffer drives one
//! `poll_ready` at a time, so the bucket needs no lock.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use tower::{Layer, Service};

#[derive(Debug, Clone, Copy)]
pub struct ThrottleLayer {
    qps: f64,
    burst: f64,
}

impl ThrottleLayer {
    /// `qps` requests per second on average, `burst` at once; `qps` 0: no limit.
    pub fn new(qps: u32, burst: u32) -> ThrottleLayer {
        ThrottleLayer {
            qps: f64::from(qps),
            burst: f64::from(burst.max(1)),
        }
    }
}

impl<S> Layer<S> for ThrottleLayer {
    type Service = Throttle<S>;

    fn layer(&self, inner: S) -> Throttle<S> {
        Throttle {
            inner,
            qps: self.qps,
            burst: self.burst,
            tokens: self.burst,
            last: Instant::now(),
            taken: false,
            sleep: None,
        }
    }
}

pub struct Throttle<S> {
    inner: S,
    qps: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
    /// A token is taken for the next call.
    taken: bool,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> Throttle<S> {
    /// Takes a token, or says how long until one is there.
    fn take(&mut self, now: Instant) -> Option<Duration> {
        let refill = now.duration_since(self.last).as_secs_f64() * self.qps;
        self.tokens = (self.tokens + refill).min(self.burst);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            None
        } else {
            Some(Duration::from_secs_f64((1.0 - self.tokens) / self.qps))
        }
    }
}

impl<S: Service<R>, R> Service<R> for Throttle<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        while self.qps > 0.0 && !self.taken {
            if let Some(sleep) = self.sleep.as_mut() {
                ready!(sleep.as_mut().poll(cx));
                self.sleep = None;
            }
            match self.take(Instant::now()) {
                None => self.taken = true,
                Some(wait) => self.sleep = Some(Box::pin(tokio::time::sleep(wait))),
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> S::Future {
        self.taken = false;
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_allows_a_burst_then_the_rate() {
        let mut t = ThrottleLayer::new(10, 3).layer(());
        let start = t.last;
        for _ in 0..3 {
            assert_eq!(t.take(start), None);
        }
        // The fourth waits a tenth of a second, and gets it after that.
        let wait = t.take(start).expect("bucket empty");
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-6, "{wait:?}");
        assert_eq!(t.take(start + Duration::from_millis(100)), None);
        // Idle time refills up to the burst, not beyond.
        let later = start + Duration::from_secs(60);
        for _ in 0..3 {
            assert_eq!(t.take(later), None);
        }
        assert!(t.take(later).is_some());
    }
}
