package dispatch

import "time"

// What the external tests (package dispatch_test) need to see of the
// dispatcher's insides.

// ErrorKind, Retriable, Permanent and Classify are errorKind, retriable,
// permanent and classify.
type ErrorKind = errorKind

const (
	Retriable = retriable
	Permanent = permanent
	MinIdle   = minIdle
)

// ErrCrashed is what a round stopped by CrashAfterPublish returns.
var ErrCrashed = errCrashed

func Classify(err error) (ErrorKind, string) { return classify(err) }

// Rounds returns how many rounds d ran.
func (d *Dispatcher) Rounds() int { return d.rounds }

// CrashAfterPublish makes d's rounds stop between publish and finalize with
// err, as a crash would.
func (d *Dispatcher) CrashAfterPublish(err error) { d.afterPublish = func() error { return err } }

// SetLimitedFor sets how long d trusts its list of rate-limited targets.
func (d *Dispatcher) SetLimitedFor(dur time.Duration) { d.limitedFor = dur }

// SetPollInterval sets d's poll interval.
func (d *Dispatcher) SetPollInterval(dur time.Duration) { d.cfg.PollInterval = dur }

// AfterPublish makes f run in d's rounds between publish and finalize; an
// error from f stops the round there, as a crash would.
func (d *Dispatcher) AfterPublish(f func() error) { d.afterPublish = f }
