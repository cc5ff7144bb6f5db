package deferclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/deferq/scheduler/internal/keystate"
)

// Reasons a business key is blocked, in KeyState.Reason.
const (
	// ReasonPending: a message of the key this consumer group deferred
	// waits in the scheduler.
	ReasonPending = keystate.ReasonPending
	// ReasonParked: the key's first message is parked and holds the key.
	ReasonParked = keystate.ReasonParked
	// ReasonInFlight: the scheduler republished a message of the key and
	// the group has not committed past it yet.
	ReasonInFlight = keystate.ReasonInFlight
	// ReasonRejected: a message of the key this group deferred was
	// rejected by the scheduler (a bad record) and waits for an operator.
	ReasonRejected = keystate.ReasonRejected
	// ReasonLocal: this process deferred a message of the key, and the
	// scheduler has not confirmed it yet.
	ReasonLocal = "local"
	// ReasonUnknown: the scheduler did not answer, or could not vouch for
	// its answer in time; the key counts as blocked, never as free.
	ReasonUnknown = "unknown"
)

// KeyState says whether a business key is blocked for the Client's group.
type KeyState struct {
	Blocked bool
	// Reason is one of the Reason constants; "" when not blocked.
	Reason string
	// HeadSeq is the defer.seq of the key's first waiting message (pending
	// or parked), 0 when none: a record the scheduler republished with a
	// lower defer.seq goes ahead of it, one with a higher one waits.
	HeadSeq int64
}

// ErrUnsure is returned, wrapped, by KeyStates when the scheduler cannot
// say: it is down, it refused the question, or its ingest did not catch up
// with the defer topic within the wait. Treat the keys as blocked.
var ErrUnsure = errors.New("the scheduler cannot vouch for the keys' state")

// KeyStates asks the scheduler whether keys are blocked for the Client's
// consumer group, in one request. The answer reflects every record
// produced to the defer topic before the call (the scheduler waits for its
// ingest to catch up, at most Config.KeyStateWait), and this process's own
// deferrals even before the scheduler stored them. On error, which wraps
// ErrUnsure, every key is returned blocked with ReasonUnknown.
func (c *Client) KeyStates(ctx context.Context, keys []string) (map[string]KeyState, error) {
	states := make(map[string]KeyState, len(keys))
	var ask []string
	for _, k := range keys {
		if _, seen := states[k]; seen || k == "" {
			continue
		}
		states[k] = KeyState{}
		ask = append(ask, k)
	}
	if len(ask) == 0 {
		return states, nil
	}
	asked := time.Now()
	var answer []keystate.State
	var err error
	for from := 0; from < len(ask) && err == nil; from += keystate.MaxKeys {
		var part []keystate.State
		part, err = c.query(ctx, ask[from:min(from+keystate.MaxKeys, len(ask))])
		answer = append(answer, part...)
	}
	if err != nil {
		for _, k := range ask {
			states[k] = KeyState{Blocked: true, Reason: ReasonUnknown}
		}
		c.count(func(s *Stats) { s.QueryFailures++ })
		return states, fmt.Errorf("deferclient: key state of %d keys: %w: %v", len(ask), ErrUnsure, err)
	}
	c.count(func(s *Stats) { s.Queries++ })
	for _, st := range answer {
		states[st.Key] = KeyState{Blocked: st.Blocked, Reason: st.Reason, HeadSeq: st.HeadSeq}
	}
	// What this process deferred after the question was sent may not be in
	// the answer: it still counts. What it deferred before, the answer
	// covers, so it is forgotten.
	c.pendingMu.Lock()
	defer c.pendingMu.Unlock()
	for _, k := range ask {
		local, ok := c.pending[k]
		if !ok {
			continue
		}
		if local.at.Before(asked) {
			delete(c.pending, k)
			continue
		}
		if !states[k].Blocked {
			states[k] = KeyState{Blocked: true, Reason: ReasonLocal, HeadSeq: local.seq}
		}
	}
	return states, nil
}

// query sends one key-state request, to each scheduler URL in turn until
// one answers: a replica that is down or cannot vouch for its answer (5xx)
// says nothing about the others, which share its database.
func (c *Client) query(ctx context.Context, keys []string) ([]keystate.State, error) {
	if len(c.urls) == 0 || c.cfg.Group == "" {
		return nil, errors.New("the Client has no SchedulerURL or no Group")
	}
	body, err := json.Marshal(keystate.Request{Group: c.cfg.Group, Keys: keys, WaitMillis: int(c.cfg.KeyStateWait.Milliseconds())})
	if err != nil {
		return nil, err
	}
	first := int(c.next.Add(1)) % len(c.urls)
	var errs []error
	for i := range c.urls {
		u := c.urls[(first+i)%len(c.urls)]
		states, retry, err := c.ask(ctx, u, keys, body)
		if err == nil {
			return states, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", u, err))
		if !retry || ctx.Err() != nil {
			break
		}
	}
	return nil, errors.Join(errs...)
}

// ask sends one key-state request to the scheduler at url; retry says
// whether another replica may answer where this one did not.
func (c *Client) ask(ctx context.Context, url string, keys []string, body []byte) (_ []keystate.State, retry bool, _ error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+keystate.Path, bytes.NewReader(body))
	if err != nil {
		return nil, false, err
	}
	req.Header.Set("Content-Type", "application/json")
	if len(c.cfg.SourceKey) > 0 {
		ts := time.Now().Unix()
		req.Header.Set(keystate.HeaderSource, c.cfg.Source)
		req.Header.Set(keystate.HeaderTimestamp, strconv.FormatInt(ts, 10))
		req.Header.Set(keystate.HeaderSignature, keystate.Sign(c.cfg.SourceKey, ts, body))
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, true, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, true, err
	}
	if resp.StatusCode != http.StatusOK {
		retry := resp.StatusCode >= 500
		var e keystate.ErrorResponse
		if json.Unmarshal(raw, &e) == nil && e.Error != "" {
			return nil, retry, fmt.Errorf("%s: %s", resp.Status, e.Error)
		}
		return nil, retry, fmt.Errorf("%s", resp.Status)
	}
	var out keystate.Response
	if err := json.Unmarshal(raw, &out); err != nil {
		return nil, false, fmt.Errorf("the scheduler's answer is not the JSON expected: %w", err)
	}
	if len(out.Keys) != len(keys) {
		return nil, false, fmt.Errorf("the scheduler answered for %d keys, asked about %d", len(out.Keys), len(keys))
	}
	for i, st := range out.Keys {
		if st.Key != keys[i] {
			return nil, false, fmt.Errorf("the scheduler's answer %d is about %q, asked about %q", i, st.Key, keys[i])
		}
	}
	return out.Keys, false, nil
}

// remember notes a deferral of key by this process, with the deferred
// record's defer.seq (0 for a new message).
func (c *Client) remember(key string, seq int64) {
	c.pendingMu.Lock()
	defer c.pendingMu.Unlock()
	cur, ok := c.pending[key]
	if ok && cur.seq != 0 && (seq == 0 || seq > cur.seq) {
		seq = cur.seq // the earliest waiting message is what blocks
	}
	c.pending[key] = localDeferral{at: time.Now(), seq: seq}
}
