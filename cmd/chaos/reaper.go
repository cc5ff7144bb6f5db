package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
)

// reaper stands in for a session timeout that kfake does not always
// enforce: it removes from a consumer group the members of processes the
// run killed (or that exited) once their session has expired, as a Kafka
// broker would. It is docs/chaos.md's finding 2.
//
// In kfake (the version in go.mod; file:line below), a process SIGKILLed
// while its JoinGroup is parked at the coordinator still counts as joined:
// completeRebalance keeps every member whose waitingReply is set
// (groups.go:1370), so the dead process becomes a member of the next
// generation and the leader assigns it partitions. The session timer of a
// member is armed when the coordinator replies to it, and only if the reply
// is taken (group.reply, groups.go:1705-1713); the pending timer it had
// before joining was stopped (addMemberAndRebalance, groups.go:1618). For a
// connection that is gone, clientReq.reply (client_conn.go:74) selects
// between sending on the connection's response channel, which has room
// (buffered, cluster.go:431), and its closed done channel: Go picks either,
// so half the time no session timer is ever armed. The one other timer that
// would drop a member that never sends SyncGroup (tPendingSync,
// groups.go:1442) is stopped when the leader's SyncGroup arrives
// (completeLeaderSync, groups.go:1483). The dead member then stays in the
// Stable group for good with its partitions, which nobody reads: every live
// process is joined and ready, and nothing makes the group rebalance again.
// (And when something does, the rebalance waits for the member that never
// rejoins until the rebalance timeout, which kfake restarts on every
// JoinGroup (group.rebalance, groups.go:1345): live members whose JoinGroup
// times out and is retried can keep it from ever completing.) Kafka
// schedules the heartbeat expiration of every member when a join completes,
// whether or not the response reached it (GroupCoordinator.onCompleteJoin:
// completeAndScheduleNextHeartbeatExpiration for each member), so there such
// a member is removed after its session timeout and its partitions are
// reassigned; the service relies on that.
//
// The reaper acts only on members whose client ID belongs to a process that
// is gone (client IDs are unique per process, see proc.clientID), and only
// once Kafka would have removed them: a session timeout after the process
// went, and after the member was first seen in a completed join (group
// CompletingRebalance or Stable), where Kafka starts that timeout at the
// latest, or, for a member never seen there, a rebalance timeout plus a
// session timeout after it was first seen at all (Kafka completes a join by
// the rebalance timeout, whoever has not rejoined). It sends a LeaveGroup
// for them, which kfake handles as it does an expired session (removes the
// member and rebalances).
type reaper struct {
	kc    *kfake.Cluster
	addr  string // the broker's
	group string
	// gone returns the client IDs of the processes that are gone, with when
	// they went (fleet.gone).
	gone func() map[string]time.Time
	// session and rebalance are the services' consumer-group session and
	// rebalance timeouts.
	session, rebalance time.Duration
	say                func(string, ...any)

	seen    map[string]time.Time // member ID -> first seen in the group
	joined  map[string]time.Time // member ID -> first seen in a completed join
	evicted int
}

// run checks the group every poll until ctx ends and returns how many
// members it evicted.
func (r *reaper) run(ctx context.Context, poll time.Duration) int {
	r.seen, r.joined = map[string]time.Time{}, map[string]time.Time{}
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return r.evicted
		case <-t.C:
		}
		r.check()
	}
}

func (r *reaper) check() {
	g := r.kc.GroupInfo(r.group)
	if g == nil {
		return
	}
	completed := g.State == "CompletingRebalance" || g.State == "Stable"
	gone := r.gone()
	now := time.Now()
	var expired []string
	for _, m := range g.Members {
		if _, ok := r.seen[m.MemberID]; !ok {
			r.seen[m.MemberID] = now
		}
		if _, ok := r.joined[m.MemberID]; !ok && completed {
			r.joined[m.MemberID] = now
		}
		died, dead := gone[m.ClientID]
		if !dead || now.Sub(died) < r.session {
			continue
		}
		joined, ok := r.joined[m.MemberID]
		if (ok && now.Sub(joined) >= r.session) || now.Sub(r.seen[m.MemberID]) >= r.rebalance+r.session {
			expired = append(expired, m.MemberID)
		}
	}
	if len(expired) == 0 {
		return
	}
	removed, err := leaveGroup(r.addr, r.group, expired)
	if err != nil {
		r.say("removing members of gone processes from group %s: %v", r.group, err)
		return
	}
	if len(removed) > 0 {
		r.evicted += len(removed)
		r.say("removed %s from group %s: their processes are gone and their session expired, but the broker kept them (kfake, see reaper in cmd/chaos)",
			strings.Join(removed, ", "), r.group)
	}
}

// leaveGroup sends one LeaveGroup for members of group and returns those
// that were removed (the others had left meanwhile).
func leaveGroup(addr, group string, members []string) ([]string, error) {
	b := sarama.NewBroker(addr)
	if err := b.Open(kafkaConfig()); err != nil {
		return nil, err
	}
	defer b.Close()
	req := &sarama.LeaveGroupRequest{Version: 3, GroupId: group}
	for _, id := range members {
		req.Members = append(req.Members, sarama.MemberIdentity{MemberId: id})
	}
	resp, err := b.LeaveGroup(req)
	if err != nil {
		return nil, err
	}
	if !errors.Is(resp.Err, sarama.ErrNoError) {
		return nil, resp.Err
	}
	var removed []string
	for _, m := range resp.Members {
		switch {
		case errors.Is(m.Err, sarama.ErrNoError):
			removed = append(removed, m.MemberId)
		case errors.Is(m.Err, sarama.ErrUnknownMemberId):
		default:
			return removed, fmt.Errorf("member %s: %w", m.MemberId, m.Err)
		}
	}
	return removed, nil
}
