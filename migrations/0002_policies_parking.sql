-- Retry policies, a parking lot that holds keys, dead-letter copies, attempt
-- history, redrive and per-target rate limits (issue 3).

-- deferred_message gains what parking and redrive need.
--
-- park_holds_key: whether this message, once parked, holds its business key
-- (later messages of the key wait behind it until an operator replays or
-- deletes it). It is set at ingest from the retry policy of the target, so a
-- park by the dispatcher or by an operator's plain UPDATE follows the same
-- policy. Rows parked before this migration were parked under the old rule,
-- which released the key; they keep releasing it.
--
-- parked_at: when the row last entered the parking lot (NULL unless parked).
--
-- dlq_topic / dlq_published_at: the dead-letter topic a copy goes to when the
-- row is parked (from the policy; NULL: no copy), and when that copy was
-- acknowledged. The row stays the source of truth; the copy is a notification.
--
-- dlq_leased_until: the dead-letter publisher's lease on the copy (an outbox
-- lease, like deferred_key's): a publisher stamps it in a short statement,
-- publishes with no transaction open, and marks the copy sent in another;
-- after a failed publish it stays set for the copy's back-off. Once it has
-- passed (a publisher crashed) any publisher may take the copy again.
--
-- redrive_count: how many times an operator replayed this message's lineage
-- out of the parking lot; republished as defer.redrive-count so that loops
-- show.
ALTER TABLE deferred_message
    ADD COLUMN park_holds_key   boolean NOT NULL DEFAULT true,
    ADD COLUMN parked_at        timestamptz,
    ADD COLUMN dlq_topic        text,
    ADD COLUMN dlq_published_at timestamptz,
    ADD COLUMN dlq_leased_until timestamptz,
    ADD COLUMN redrive_count    int NOT NULL DEFAULT 0,
    ADD CONSTRAINT deferred_message_redrive_count_nonnegative CHECK (redrive_count >= 0);

-- Runs under 0001's triggers, and changes nothing they look at.
UPDATE deferred_message SET park_holds_key = false, parked_at = updated_at WHERE state = 'parked';

-- Head candidates are now pending messages and parked messages that hold
-- their key. A query for pending rows alone still uses this index: its
-- predicate implies the index's.
DROP INDEX deferred_message_key_order;
CREATE INDEX deferred_message_key_order
    ON deferred_message (business_key, seq, id)
    WHERE state = 'pending' OR (state = 'parked' AND park_holds_key);

-- Parked rows whose dead-letter copy is still to be published. The lease
-- (dlq_leased_until) is deliberately not in the predicate: stamping it is
-- then a HOT update, and the rows leased at any time are at most a batch per
-- publisher, which the claim skips cheaply.
CREATE INDEX deferred_message_dlq_unsent
    ON deferred_message (id)
    WHERE state = 'parked' AND dlq_topic IS NOT NULL AND dlq_published_at IS NULL;

-- held: the key's head is a parked message that holds the key. Its
-- next_run_at is then 'infinity', so no claim or due-time scan ever reaches it
-- and deferred_key_due stays a range of what can actually run.
--
-- throttled: the head waits for its target's pause or rate limit
-- (target_control), not for its due time. Such heads live in their own
-- index, by target, so that a paused or rate-limited target's backlog costs
-- the main claim and the next-due read nothing (docs/design.md section 4.3: blocked
-- backlog is never rescanned), and a rate-limited target's claim reads only
-- its own heads. A held head is never throttled: it waits for an operator,
-- and stays at the 'infinity' end of deferred_key_due. Kept by the head
-- triggers (which look the target up in target_control) and by
-- target_control's triggers; see deferred_key_throttle_share for the one
-- race that can leave it stale, and why that is safe.
ALTER TABLE deferred_key
    ADD COLUMN held boolean NOT NULL DEFAULT false,
    ADD COLUMN throttled boolean NOT NULL DEFAULT false;

-- Under 0001 only pauses existed.
UPDATE deferred_key k SET throttled = true
WHERE EXISTS (SELECT 1 FROM target_control c WHERE c.target_topic = k.head_target AND c.paused);

-- Every head is in exactly one of these two, so a head write costs what it
-- did with 0001's single deferred_key_due. The main claim and the next-due
-- read walk deferred_key_due from its start; a rate-limited target's claim
-- and token checks read deferred_key_throttled from (target, -infinity).
DROP INDEX deferred_key_due;
CREATE INDEX deferred_key_due ON deferred_key (next_run_at) WHERE NOT throttled;
CREATE INDEX deferred_key_throttled ON deferred_key (head_target, next_run_at) WHERE throttled;

-- The attempt history: one row per thing that happened to a message, kept
-- after the message itself is delivered and deleted, so that an operator can
-- read a lineage's whole story in SQL. A lineage is a message and every
-- re-deferral of it (records carrying defer.id of an earlier row); its id is
-- the id of the first row.
CREATE TABLE deferred_attempt (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    lineage_id    bigint NOT NULL,
    message_id    bigint NOT NULL,
    -- deferred: stored pending; parked / rejected: stored or moved there;
    -- replayed: moved from parked or rejected back to pending.
    event         text NOT NULL,
    attempt       int NOT NULL,
    reason        text,
    error_class   text,
    error_message text,
    target_topic  text,
    next_run_at   timestamptz,
    recorded_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT deferred_attempt_event_valid
        CHECK (event IN ('deferred', 'parked', 'rejected', 'replayed'))
);

CREATE INDEX deferred_attempt_lineage ON deferred_attempt (lineage_id, id);
-- (message_id, id): a lineage lookup is one index probe, first row wins.
CREATE INDEX deferred_attempt_message ON deferred_attempt (message_id, id);
-- Rows arrive in time order, so a BRIN index serves retention pruning at
-- almost no cost per insert.
CREATE INDEX deferred_attempt_recorded ON deferred_attempt USING brin (recorded_at);

COMMENT ON TABLE deferred_attempt IS
    'History of every message lineage: deferrals, parks, rejections and replays. Written by triggers on deferred_message; pruned after HISTORY_RETENTION.';

-- Rate limits per target, a token bucket shared by every dispatcher:
-- rate_limit messages per second (NULL: no limit), with up to one second of
-- burst. tokens and refilled_at belong to the dispatchers.
ALTER TABLE target_control
    ADD COLUMN rate_limit  double precision,
    ADD COLUMN tokens      double precision NOT NULL DEFAULT 0,
    ADD COLUMN refilled_at timestamptz,
    ADD CONSTRAINT target_control_rate_limit_positive
        CHECK (rate_limit IS NULL OR (rate_limit > 0 AND rate_limit < 'infinity'));

-- Throttled heads under concurrency. A head writer (the triggers below)
-- looks its target up in target_control with its statement's snapshot, so
-- it can miss an operator's change to target_control that commits meanwhile;
-- and target_control's trigger (deferred_key_rethrottle) cannot see heads
-- written by transactions that have not committed yet. Two cases:
--
--   - A target becomes throttled (paused, rate-limited) while a head of it
--     is being written: the head may be left unflagged (throttled = false).
--     That is safe: every claim still checks target_control itself
--     (dispatch_claim.sql), so the head is not sent while it must not be.
--     It costs the main claim a skipped row until the head is written again,
--     the target is un-throttled, or deferred_key_throttle_sweep() (run by
--     maintenance) flags it; a rate-limited target's head left so waits for
--     that sweep, since only flagged heads are claimed under a limit.
--   - A target stops being throttled (resumed, limit removed, row deleted)
--     while a head of it is being written: a head left flagged would never be
--     claimed. That cannot happen: a writer flags a head only while holding a
--     shared advisory lock on its target (deferred_key_throttle_share, which
--     never waits), and reads target_control again with a snapshot taken
--     after that lock; the un-throttling takes the same lock exclusively
--     before it unflags the target's heads, so it waits for the writers that
--     hold it and then sees their heads. A writer that cannot take the lock
--     (an un-throttling is under way) leaves its heads unflagged: the first
--     case.

-- deferred_key_throttle_share takes, without waiting, a shared advisory
-- lock (held to the end of the transaction) on each target among targets
-- (NULL: all) that is paused or rate-limited, and returns those it got.
-- Advisory rather than row locks: a share lock on the target_control row
-- would conflict with the dispatchers' token takes, or let a stream of
-- overlapping writers starve an operator's change, whereas the lock manager
-- queues a waiting exclusive request ahead of later shared ones (a try then
-- fails).
CREATE FUNCTION deferred_key_throttle_share(targets text[]) RETURNS text[]
LANGUAGE sql AS $$
    SELECT coalesce(array_agg(c.target_topic ORDER BY c.target_topic), '{}')
    FROM target_control c
    WHERE (targets IS NULL OR c.target_topic = ANY (targets))
      -- CASE so that only throttled targets are locked, whatever order the
      -- quals run in.
      AND CASE WHEN c.paused OR c.rate_limit IS NOT NULL
               THEN pg_try_advisory_xact_lock_shared(hashtext('deferred_key.throttled'), hashtext(c.target_topic))
               ELSE false
          END
$$;

-- Heads, now with held and throttled keys. Same structure as 0001; what
-- changed is which rows are candidates, what a held head looks like, the
-- throttled flag (see above; the EXISTS re-reads target_control after the
-- lock, and runs only for targets that were throttled), and that a key that
-- stops being held starts afresh (see deferred_key_refresh).
CREATE OR REPLACE FUNCTION deferred_key_after_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    earliest timestamptz;
    throttling text[];
BEGIN
    throttling := deferred_key_throttle_share(ARRAY(SELECT DISTINCT target_topic FROM new_rows WHERE state = 'pending'));
    WITH heads AS (
        INSERT INTO deferred_key AS k (business_key, head_id, head_seq, next_run_at, head_target, held, throttled)
        SELECT business_key, id, seq, next_run_at, target_topic, held,
               NOT held AND target_topic = ANY (throttling)
                   AND EXISTS (SELECT 1 FROM target_control c
                               WHERE c.target_topic = s.target_topic AND (c.paused OR c.rate_limit IS NOT NULL))
        FROM (
            SELECT n.business_key, n.id, n.seq, n.target_topic,
                   n.state = 'parked' AS held,
                   CASE WHEN n.state = 'parked' THEN 'infinity' ELSE n.next_run_at END AS next_run_at,
                   row_number() OVER (PARTITION BY n.business_key ORDER BY n.seq, n.id) AS rank
            FROM new_rows n
            WHERE n.state = 'pending'
               OR (n.state = 'parked' AND n.park_holds_key AND n.business_key IS NOT NULL)
        ) s
        WHERE business_key IS NULL OR rank = 1
        ORDER BY business_key, seq, id
        ON CONFLICT (business_key) DO UPDATE
            SET head_id = excluded.head_id, head_seq = excluded.head_seq, next_run_at = excluded.next_run_at,
                head_target = excluded.head_target, held = excluded.held, throttled = excluded.throttled,
                failures = CASE WHEN k.held AND NOT excluded.held THEN 0 ELSE k.failures END,
                leased_until = CASE WHEN k.held AND NOT excluded.held AND k.leased_by IS NULL THEN NULL
                                    ELSE k.leased_until END
            WHERE (excluded.head_seq, excluded.head_id) < (k.head_seq, k.head_id)
        RETURNING k.next_run_at, k.leased_until
    )
    SELECT min(next_run_at) INTO earliest FROM heads
    WHERE leased_until IS NULL OR leased_until <= now();
    PERFORM deferred_key_notify(earliest);
    RETURN NULL;
END
$$;

-- See 0001 for why this is correct under concurrency; the candidate rows,
-- the held and throttled columns, and what happens when a key stops being
-- held differ.
--
-- A key stops being held when an operator replays or deletes the parked
-- message at its head (or a re-deferral lands ahead of it). Whatever befell
-- the key before it was held is history then: the finalize that parked the
-- head may also have recorded a retriable failure of a later message of the
-- key (failures + 1, a back-off lease owned by no one), and the replayed
-- head must not wait for that back-off, up to BackoffMax. So the failure
-- count restarts at 0 and a lease owned by no one (a back-off, or expired)
-- is cleared; a lease a dispatcher holds is kept, it belongs to the key.
CREATE OR REPLACE FUNCTION deferred_key_refresh(keys text[], unordered_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    earliest timestamptz;
    earliest_unordered timestamptz;
    throttling text[];
BEGIN
    IF cardinality(keys) > 0 THEN
        INSERT INTO deferred_key AS d (business_key, head_id, head_seq, next_run_at)
        SELECT k, 0, 0, 'infinity' FROM unnest(keys) AS k ORDER BY k
        ON CONFLICT (business_key) DO UPDATE SET head_id = d.head_id WHERE false;
    END IF;
    IF cardinality(keys) > 0 OR cardinality(unordered_ids) > 0 THEN
        throttling := deferred_key_throttle_share(NULL);
    END IF;

    IF cardinality(keys) > 0 THEN
        WITH heads AS (
            SELECT k.business_key, m.id, m.seq, m.target_topic,
                   m.state = 'parked' AS held,
                   m.state = 'pending' AND m.target_topic = ANY (throttling)
                       AND EXISTS (SELECT 1 FROM target_control c
                                   WHERE c.target_topic = m.target_topic AND (c.paused OR c.rate_limit IS NOT NULL))
                       AS throttled,
                   CASE WHEN m.state = 'parked' THEN 'infinity' ELSE m.next_run_at END AS next_run_at
            FROM unnest(keys) AS k (business_key)
            LEFT JOIN LATERAL (
                SELECT id, seq, next_run_at, target_topic, state FROM deferred_message m
                WHERE m.business_key = k.business_key
                  AND (m.state = 'pending' OR (m.state = 'parked' AND m.park_holds_key))
                ORDER BY m.seq, m.id
                LIMIT 1
            ) m ON true
        ), gone AS (
            DELETE FROM deferred_key d USING heads h
            WHERE d.business_key = h.business_key AND h.id IS NULL
        ), moved AS (
            UPDATE deferred_key d
            SET head_id = h.id, head_seq = h.seq, next_run_at = h.next_run_at, head_target = h.target_topic,
                held = h.held, throttled = h.throttled,
                failures = CASE WHEN d.held AND NOT h.held THEN 0 ELSE d.failures END,
                leased_until = CASE WHEN d.held AND NOT h.held AND d.leased_by IS NULL THEN NULL
                                    ELSE d.leased_until END
            FROM heads h
            WHERE d.business_key = h.business_key AND h.id IS NOT NULL
              AND (d.head_id, d.head_seq, d.next_run_at, d.head_target, d.held, d.throttled)
                  IS DISTINCT FROM (h.id, h.seq, h.next_run_at, h.target_topic, h.held, h.throttled)
            RETURNING d.next_run_at, d.leased_until
        )
        SELECT min(next_run_at) INTO earliest FROM moved
        WHERE leased_until IS NULL OR leased_until <= now();
    END IF;

    -- Unordered messages hold no key, so parking one simply removes its head.
    IF cardinality(unordered_ids) > 0 THEN
        DELETE FROM deferred_key d
        WHERE d.business_key IS NULL AND d.head_id = ANY (unordered_ids)
          AND NOT EXISTS (
              SELECT 1 FROM deferred_message m
              WHERE m.id = d.head_id AND m.state = 'pending' AND m.business_key IS NULL);

        WITH cur AS (
            SELECT m.id, m.seq, m.next_run_at, m.target_topic,
                   m.target_topic = ANY (throttling)
                       AND EXISTS (SELECT 1 FROM target_control c
                                   WHERE c.target_topic = m.target_topic AND (c.paused OR c.rate_limit IS NOT NULL))
                       AS throttled
            FROM deferred_message m
            WHERE m.id = ANY (unordered_ids) AND m.state = 'pending' AND m.business_key IS NULL
        ), moved AS (
            UPDATE deferred_key d
            SET head_seq = m.seq, next_run_at = m.next_run_at, head_target = m.target_topic, throttled = m.throttled
            FROM cur m
            WHERE d.business_key IS NULL AND d.head_id = m.id
              AND (d.head_seq, d.next_run_at, d.head_target, d.throttled)
                  IS DISTINCT FROM (m.seq, m.next_run_at, m.target_topic, m.throttled)
            RETURNING d.next_run_at, d.leased_until
        ), added AS (
            INSERT INTO deferred_key (business_key, head_id, head_seq, next_run_at, head_target, throttled)
            SELECT NULL, m.id, m.seq, m.next_run_at, m.target_topic, m.throttled
            FROM cur m
            WHERE NOT EXISTS (SELECT 1 FROM deferred_key d WHERE d.business_key IS NULL AND d.head_id = m.id)
            RETURNING next_run_at, leased_until
        )
        SELECT min(next_run_at) INTO earliest_unordered
        FROM (SELECT * FROM moved UNION ALL SELECT * FROM added) c
        WHERE leased_until IS NULL OR leased_until <= now();
    END IF;

    PERFORM deferred_key_notify(least(earliest, earliest_unordered));
END
$$;

CREATE OR REPLACE FUNCTION deferred_key_after_update() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    keys text[];
    ids bigint[];
BEGIN
    SELECT array_agg(DISTINCT k ORDER BY k) FILTER (WHERE k IS NOT NULL),
           array_agg(DISTINCT u) FILTER (WHERE u IS NOT NULL)
    INTO keys, ids
    FROM (
        SELECT o.business_key AS k, CASE WHEN o.business_key IS NULL THEN o.id END AS u
        FROM old_rows o JOIN new_rows n ON n.id = o.id
        WHERE (o.business_key, o.seq, o.next_run_at, o.state, o.target_topic, o.park_holds_key)
              IS DISTINCT FROM (n.business_key, n.seq, n.next_run_at, n.state, n.target_topic, n.park_holds_key)
        UNION ALL
        SELECT n.business_key, CASE WHEN n.business_key IS NULL THEN n.id END
        FROM old_rows o JOIN new_rows n ON n.id = o.id
        WHERE (o.business_key, o.seq, o.next_run_at, o.state, o.target_topic, o.park_holds_key)
              IS DISTINCT FROM (n.business_key, n.seq, n.next_run_at, n.state, n.target_topic, n.park_holds_key)
        UNION ALL
        SELECT o.business_key, CASE WHEN o.business_key IS NULL THEN o.id END
        FROM old_rows o WHERE NOT EXISTS (SELECT 1 FROM new_rows n WHERE n.id = o.id)
        UNION ALL
        SELECT n.business_key, CASE WHEN n.business_key IS NULL THEN n.id END
        FROM new_rows n WHERE NOT EXISTS (SELECT 1 FROM old_rows o WHERE o.id = n.id)
    ) c;
    PERFORM deferred_key_refresh(coalesce(keys, '{}'), coalesce(ids, '{}'));
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION deferred_key_after_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    keys text[];
    ids bigint[];
BEGIN
    SELECT array_agg(DISTINCT business_key ORDER BY business_key)
               FILTER (WHERE business_key IS NOT NULL),
           array_agg(id) FILTER (WHERE business_key IS NULL AND state = 'pending')
    INTO keys, ids
    FROM old_rows
    WHERE state = 'pending' OR (state = 'parked' AND park_holds_key);
    PERFORM deferred_key_refresh(coalesce(keys, '{}'), coalesce(ids, '{}'));
    RETURN NULL;
END
$$;

-- parked_at follows the state; leaving the parking lot also forgets that a
-- dead-letter copy was sent, so parking again sends a new one, at once: the
-- lease (or back-off) of the old copy goes too. A publisher still sending
-- the old copy then does not mark the new stay's copy sent: it marks only a
-- row whose parked_at is the one it read (dlq_mark_published.sql).
CREATE OR REPLACE FUNCTION deferred_message_touch() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        IF NEW.state = 'parked' THEN
            NEW.parked_at := now();
        ELSE
            NEW.parked_at := NULL;
        END IF;
        IF OLD.state = 'parked' THEN
            NEW.dlq_published_at := NULL;
            NEW.dlq_leased_until := NULL;
        END IF;
    END IF;
    RETURN NEW;
END
$$;

-- History. A re-deferral joins the lineage of the row it names in defer.id
-- (origin_id); if that row's history is gone (pruned), the lineage is named
-- after origin_id itself.
CREATE FUNCTION deferred_attempt_after_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt, reason, error_class, error_message,
                                  target_topic, next_run_at)
    -- Most rows are not re-deferrals: the lookup runs only for those that
    -- are, as one probe of deferred_attempt_message each.
    SELECT coalesce(CASE WHEN n.origin_id IS NOT NULL THEN
                        (SELECT a.lineage_id FROM deferred_attempt a
                         WHERE a.message_id = n.origin_id ORDER BY a.message_id, a.id LIMIT 1)
                    END, n.origin_id, n.id),
           n.id,
           CASE n.state WHEN 'pending' THEN 'deferred' ELSE n.state END,
           n.attempt, n.reason, n.error_class, n.error_message, n.target_topic, n.next_run_at
    FROM new_rows n
    ORDER BY n.id;
    RETURN NULL;
END
$$;

CREATE FUNCTION deferred_attempt_after_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt, reason, error_class, error_message,
                                  target_topic, next_run_at)
    SELECT coalesce((SELECT a.lineage_id FROM deferred_attempt a
                     WHERE a.message_id = n.id ORDER BY a.message_id, a.id LIMIT 1),
                    CASE WHEN n.origin_id IS NOT NULL THEN
                        (SELECT a.lineage_id FROM deferred_attempt a
                         WHERE a.message_id = n.origin_id ORDER BY a.message_id, a.id LIMIT 1)
                    END, n.origin_id, n.id),
           n.id,
           CASE n.state WHEN 'pending' THEN 'replayed' ELSE n.state END,
           n.attempt, n.reason, n.error_class, n.error_message, n.target_topic, n.next_run_at
    FROM old_rows p
    JOIN new_rows n ON n.id = p.id
    WHERE p.state IS DISTINCT FROM n.state
    ORDER BY n.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER deferred_attempt_insert AFTER INSERT ON deferred_message
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_attempt_after_insert();

CREATE TRIGGER deferred_attempt_update AFTER UPDATE ON deferred_message
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_attempt_after_update();

-- Dispatchers update tokens and refilled_at on every take; only an
-- operator's change of what a target may do should wake them all.
DROP TRIGGER target_control_changed ON target_control;
CREATE TRIGGER target_control_changed AFTER INSERT OR DELETE ON target_control
    FOR EACH STATEMENT EXECUTE FUNCTION target_control_notify();
CREATE TRIGGER target_control_updated AFTER UPDATE OF paused, rate_limit ON target_control
    FOR EACH STATEMENT EXECUTE FUNCTION target_control_notify();

-- deferred_key_rethrottle sets deferred_key.throttled of every head (not
-- held) of target to whether target is paused or rate-limited now. Run for
-- each target an operator's change to target_control affects; it sees that
-- change, being in the same transaction. Un-throttling first takes the
-- target's advisory lock exclusively (see deferred_key_throttle_share): it
-- waits for the head writers that flagged heads of the target under the old
-- setting, and is then sure to see their heads.
--
-- Rows are locked in key order first, as finalize and the head triggers lock
-- them, so that this cannot deadlock with them; then flagged, by a second
-- statement that sees the rows it locked. Finding the heads of a target that
-- is becoming throttled reads all of deferred_key (the unflagged heads are
-- not indexed by target): acceptable for an operator's pause or limit, not
-- for anything per poll.
CREATE FUNCTION deferred_key_rethrottle(target text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM target_control c
               WHERE c.target_topic = target AND (c.paused OR c.rate_limit IS NOT NULL)) THEN
        PERFORM FROM deferred_key
        WHERE NOT throttled AND NOT held AND head_target = target
        ORDER BY business_key, head_id
        FOR NO KEY UPDATE;
        UPDATE deferred_key SET throttled = true WHERE NOT throttled AND NOT held AND head_target = target;
    ELSE
        PERFORM pg_advisory_xact_lock(hashtext('deferred_key.throttled'), hashtext(target));
        PERFORM FROM deferred_key
        WHERE throttled AND head_target = target
        ORDER BY business_key, head_id
        FOR NO KEY UPDATE;
        UPDATE deferred_key SET throttled = false WHERE throttled AND head_target = target;
    END IF;
END
$$;

CREATE FUNCTION target_control_throttle() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.paused OR NEW.rate_limit IS NOT NULL THEN
            PERFORM deferred_key_rethrottle(NEW.target_topic);
        END IF;
    ELSIF TG_OP = 'DELETE' THEN
        IF OLD.paused OR OLD.rate_limit IS NOT NULL THEN
            PERFORM deferred_key_rethrottle(OLD.target_topic);
        END IF;
    ELSIF NEW.target_topic IS DISTINCT FROM OLD.target_topic THEN
        PERFORM deferred_key_rethrottle(OLD.target_topic);
        PERFORM deferred_key_rethrottle(NEW.target_topic);
    ELSIF (NEW.paused OR NEW.rate_limit IS NOT NULL) IS DISTINCT FROM (OLD.paused OR OLD.rate_limit IS NOT NULL) THEN
        PERFORM deferred_key_rethrottle(NEW.target_topic);
    END IF;
    RETURN NULL;
END
$$;

-- A row trigger: it can name the columns, so the dispatchers' token takes
-- (tokens, refilled_at) do not fire it.
CREATE TRIGGER target_control_throttle
    AFTER INSERT OR UPDATE OF target_topic, paused, rate_limit OR DELETE ON target_control
    FOR EACH ROW EXECUTE FUNCTION target_control_throttle();

-- TRUNCATE waits for every transaction that read target_control, so no
-- head writer can be flagging a head meanwhile.
CREATE FUNCTION target_control_after_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE deferred_key SET throttled = false WHERE throttled;
    RETURN NULL;
END
$$;

CREATE TRIGGER target_control_truncate AFTER TRUNCATE ON target_control
    FOR EACH STATEMENT EXECUTE FUNCTION target_control_after_truncate();

-- deferred_key_throttle_sweep repairs throttled flags left stale (see
-- "Throttled heads under concurrency" above), returning how many it changed.
-- It flags heads only as a head writer does (shared lock, then a fresh
-- read), so it cannot race an un-throttling into a stale flag. Maintenance
-- runs it (sql/queries/dispatch_throttle_sweep.sql); it reads all of deferred_key.
CREATE FUNCTION deferred_key_throttle_sweep() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    throttling text[];
    flagged bigint;
    unflagged bigint;
BEGIN
    throttling := deferred_key_throttle_share(NULL);
    UPDATE deferred_key k SET throttled = true
    WHERE NOT k.throttled AND NOT k.held AND k.head_target = ANY (throttling)
      AND EXISTS (SELECT 1 FROM target_control c
                  WHERE c.target_topic = k.head_target AND (c.paused OR c.rate_limit IS NOT NULL));
    GET DIAGNOSTICS flagged = ROW_COUNT;
    -- Unflagging is always safe (claims check target_control anyway).
    UPDATE deferred_key k SET throttled = false
    WHERE k.throttled
      AND (k.held OR NOT EXISTS (SELECT 1 FROM target_control c
                                 WHERE c.target_topic = k.head_target AND (c.paused OR c.rate_limit IS NOT NULL)));
    GET DIAGNOSTICS unflagged = ROW_COUNT;
    RETURN flagged + unflagged;
END
$$;

-- PL/pgSQL keeps each statement's plan for the life of the connection, and
-- after a few calls settles on a generic plan made without the actual
-- arrays. A generic plan made while deferred_key was small can join it by a
-- full scan, and keep doing so at a million keys (seen in the benchmark: a
-- finalize taking seconds). Planning each call with the real arguments costs
-- well under a millisecond per statement, once per batch, not per message.
ALTER FUNCTION deferred_key_refresh(text[], bigint[]) SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION deferred_key_after_insert() SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION deferred_key_after_update() SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION deferred_key_after_delete() SET plan_cache_mode = force_custom_plan;
