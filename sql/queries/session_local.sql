-- Settings for the rest of one transaction (set_config's is_local), in
-- one round trip: the operator commands' defaults for lock_timeout and
-- statement_timeout (internal/opscli). Not startup parameters, which most
-- connection poolers refuse, nor a session's SET, which behind a pooler
-- in transaction mode would stay on a server session other clients use.
SELECT
FROM unnest($1::text[], $2::text[]) AS s (name, value)
CROSS JOIN LATERAL set_config(s.name, s.value, true)
