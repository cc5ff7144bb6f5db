package gate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
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

// KeyState says whether a business key is blocked for the client's group.
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

// KeyStates asks the scheduler whether keys are blocked for the Gate's
// consumer group, in one request. The answer reflects every record
// produced to the defer topic before the call (the scheduler waits for its
// ingest to catch up, at most Config.KeyStateWait), and this process's own
// deferrals even before the scheduler stored them. On error, which wraps
// ErrUnsure, every key is returned blocked with ReasonUnknown.
func (g *Gate) KeyStates(ctx context.Context, keys []string) (map[string]KeyState, error) {
	return g.keyStates(ctx, keys, true)
}

// keyStates is KeyStates; with all false the scheduler waits for nothing
// but answers at once, and this process's deferrals count as blocked
// until an answer's Stored covers them. A consumer may ask so once an
// answer that waited for all came after it got its partitions: the
// deferrals it cannot know of are its predecessors', which that answer
// covered (docs/design.md, "Read-your-writes").
func (g *Gate) keyStates(ctx context.Context, keys []string, all bool) (map[string]KeyState, error) {
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
	// stored is, per partition of the defer topic, the least that every
	// answer covers.
	var stored map[int32]int64
	var err error
	waitedAll := true // every request of this call waited for all
	for from := 0; from < len(ask) && err == nil; from += keystate.MaxKeys {
		var part keystate.Response
		var waited bool
		part, waited, err = g.query(ctx, ask[from:min(from+keystate.MaxKeys, len(ask))], all)
		waitedAll = waitedAll && waited
		answer = append(answer, part.Keys...)
		if from == 0 {
			stored = part.Stored
			continue
		}
		for p, next := range stored {
			if other, ok := part.Stored[p]; !ok || other < next {
				stored[p] = other // 0 when missing: covers nothing
			}
		}
	}
	if err != nil {
		for _, k := range ask {
			states[k] = KeyState{Blocked: true, Reason: ReasonUnknown}
		}
		g.count(func(s *Stats) { s.QueryFailures++ })
		return states, fmt.Errorf("deferclient: key state of %d keys: %w: %v", len(ask), ErrUnsure, err)
	}
	g.count(func(s *Stats) { s.Queries++ })
	for _, st := range answer {
		states[st.Key] = KeyState{Blocked: st.Blocked, Reason: st.Reason, HeadSeq: st.HeadSeq}
	}
	// A deferral of this process's that the answer may not cover still
	// counts. One the answer covers is forgotten: one made before a
	// question that waited for all, or one below what the answer says
	// ingest had stored. Not while the gate follows a blocked-key set:
	// the set may not hold the key yet, and the answer's state is not
	// the set's to take (it may be newer than a feed answer still on its
	// way); the feed forgets it once it put the key's state in the set.
	g.set.mu.Lock()
	following := g.set.following
	g.set.mu.Unlock()
	g.pendingMu.Lock()
	defer g.pendingMu.Unlock()
	for _, k := range ask {
		local, ok := g.pending[k]
		if !ok {
			continue
		}
		if next, ok := stored[local.partition]; !following && ((waitedAll && local.at.Before(asked)) || (ok && next > local.offset)) {
			delete(g.pending, k)
			continue
		}
		// Blocked by it, and behind it where it waits ahead of what the
		// scheduler answered: a re-deferred record keeps its seq, and
		// what the scheduler republished after it must wait for it.
		states[k] = block(states[k], local.seq)
	}
	return states, nil
}

// query sends one key-state request, to each scheduler URL in turn until
// one answers: a replica that is down or cannot vouch for its answer (5xx)
// says nothing about the others, which share its database.
// waitedAll says whether the answer waited for the whole defer topic,
// which it does when all is set, and when the scheduler knows no other
// wait.
func (g *Gate) query(ctx context.Context, keys []string, all bool) (_ keystate.Response, waitedAll bool, _ error) {
	if len(g.urls) == 0 || g.cfg.Group == "" {
		return keystate.Response{}, false, errors.New("no SchedulerURL or no Group is configured")
	}
	req := keystate.Request{Group: g.cfg.Group, Keys: keys, WaitMillis: int(g.cfg.KeyStateWait.Milliseconds())}
	if !all && !g.waitAllOnly.Load() {
		req.Wait = keystate.WaitPositions
	}
	body, err := json.Marshal(req)
	if err != nil {
		return keystate.Response{}, false, err
	}
	first := int(g.next.Add(1)) % len(g.urls)
	var errs []error
	for i := range g.urls {
		u := g.urls[(first+i)%len(g.urls)]
		resp, retry, err := g.ask(ctx, u, keys, body)
		if err == nil {
			return resp, req.Wait == "", nil
		}
		if req.Wait != "" && strings.Contains(err.Error(), `unknown field "wait"`) {
			// A scheduler of an older release, during a rolling
			// upgrade: ask as it understands, waiting for all.
			g.waitAllOnly.Store(true)
			return g.query(ctx, keys, true)
		}
		errs = append(errs, fmt.Errorf("%s: %w", u, err))
		if !retry || ctx.Err() != nil {
			break
		}
	}
	return keystate.Response{}, false, errors.Join(errs...)
}

// ask sends one key-state request to the scheduler at url; retry says
// whether another replica may answer where this one did not.
func (g *Gate) ask(ctx context.Context, url string, keys []string, body []byte) (_ keystate.Response, retry bool, _ error) {
	var none keystate.Response
	raw, status, err := g.post(ctx, url+keystate.Path, body)
	if err != nil {
		return none, status == 0 || status >= 500, err
	}
	var out keystate.Response
	if err := json.Unmarshal(raw, &out); err != nil {
		return none, false, fmt.Errorf("the scheduler's answer is not the JSON expected: %w", err)
	}
	if len(out.Keys) != len(keys) {
		return none, false, fmt.Errorf("the scheduler answered for %d keys, asked about %d", len(out.Keys), len(keys))
	}
	for i, st := range out.Keys {
		if st.Key != keys[i] {
			return none, false, fmt.Errorf("the scheduler's answer %d is about %q, asked about %q", i, st.Key, keys[i])
		}
	}
	return out, false, nil
}

// remember notes a deferral of key by this process, with the deferred
// record's defer.seq (0 for a new message) and where it went in the defer
// topic.
func (g *Gate) remember(key string, seq int64, partition int32, offset int64) {
	g.pendingMu.Lock()
	defer g.pendingMu.Unlock()
	cur, ok := g.pending[key]
	if ok && cur.seq != 0 && (seq == 0 || seq > cur.seq) {
		seq = cur.seq // the earliest waiting message is what blocks
	}
	if ok && cur.partition == partition && cur.offset > offset {
		offset = cur.offset // the latest deferral is what must be stored
	}
	g.pending[key] = localDeferral{at: time.Now(), seq: seq, partition: partition, offset: offset}
}
