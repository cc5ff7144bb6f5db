package deferclient

import (
	"context"

	"github.com/deferq/scheduler/deferclient/gate"
)

// Reasons a business key is blocked, in KeyState.Reason.
const (
	// ReasonPending: a message of the key this consumer group deferred
	// waits in the scheduler.
	ReasonPending = gate.ReasonPending
	// ReasonParked: the key's first message is parked and holds the key.
	ReasonParked = gate.ReasonParked
	// ReasonInFlight: the scheduler republished a message of the key and
	// the group has not committed past it yet.
	ReasonInFlight = gate.ReasonInFlight
	// ReasonRejected: a message of the key this group deferred was
	// rejected by the scheduler (a bad record) and waits for an operator.
	ReasonRejected = gate.ReasonRejected
	// ReasonLocal: this process deferred a message of the key, and the
	// scheduler has not confirmed it yet.
	ReasonLocal = gate.ReasonLocal
	// ReasonUnknown: the scheduler did not answer, or could not vouch for
	// its answer in time; the key counts as blocked, never as free.
	ReasonUnknown = gate.ReasonUnknown
)

// KeyState says whether a business key is blocked for the Client's group.
type KeyState = gate.KeyState

// ErrUnsure is returned, wrapped, by KeyStates when the scheduler cannot
// say: it is down, it refused the question, or its ingest did not catch up
// with the defer topic within the wait. Treat the keys as blocked.
var ErrUnsure = gate.ErrUnsure

// KeyStates asks the scheduler whether keys are blocked for the Client's
// consumer group, in one request. The answer reflects every record
// produced to the defer topic before the call (the scheduler waits for its
// ingest to catch up, at most Config.KeyStateWait), and this process's own
// deferrals even before the scheduler stored them. On error, which wraps
// ErrUnsure, every key is returned blocked with ReasonUnknown.
func (c *Client) KeyStates(ctx context.Context, keys []string) (map[string]KeyState, error) {
	return c.gate.KeyStates(ctx, keys)
}
